"""The GDN pipeline: conv1d -> split q|k|v -> gating -> gated delta rule, for prefill, decode and verify.

Prefill runs the gating op, then the chunked rule; decode and verify hand the raw ``a``/``b`` with
``A_log``/``dt_bias`` to the recurrent / verify op, which computes the gating itself (fused: one launch
fewer per layer, what a small batch pays for; the reference computes exactly the unfused pair).

One implementation for every runner: the standalone engine's core, the vLLM plugin's core and the dense
parity core all call :func:`gdn_forward` (or one of the part functions) with

- ``kernels``: the selected ``atom_kernels`` ops;
- ``geometry``: :class:`~atom_models.gdn_state.GDNGeometry` (heads, dims, scale);
- ``weights``: :class:`~atom_models.gdn_meta.GDNWeights` of the layer;
- ``state``: :class:`~atom_models.gdn_state.GDNLayerState` of the layer (conv, ssm, pending);
- the flat batch's pre-conv ``mixed_qkv[T, C]`` (``[q | k | v]``), ``b[T, Hv]``, ``a[T, Hv]``: views of the
  layer's projection outputs (any row stride, unit last stride), handed to the kernels as they are (their
  stride contract: docs/kernel-api.md, "Strides"); only a gather by index (prefill ``token_index``, verify
  ``gather_index``) copies rows;
- ``step``: :class:`~atom_models.gdn_meta.GDNStepMeta`, built once per step.

:func:`gdn_decode` and :func:`gdn_verify` do no host work beyond reading shapes: no value of a device
tensor reaches Python, so they can be captured in a CUDA graph. :func:`gdn_prefill` may gather by an
index tensor but reads no values either (the kernels it calls may, on the host-driven prefill path).
"""

from __future__ import annotations

import torch

from atom_models.gdn_meta import GDNDecodeMeta, GDNPrefillMeta, GDNStepMeta, GDNVerifyMeta, GDNWeights
from atom_models.gdn_snapshot import SlotCopier, put_positions, resume_pending
from atom_models.gdn_state import GDNGeometry, GDNLayerState


def reset_pending(pending: torch.Tensor | None, slots: torch.Tensor) -> None:
    """Make ``pending[s, 0]`` an identity token (all zeros) for every real slot ``s >= 0`` of ``slots``.

    Called after a step that wrote the committed state of ``s`` directly (prefill, plain decode): the
    next verify commits ``num_accepted = 1`` pending token, which then changes nothing. Padding rows
    (slot < 0) write zeros into the largest real slot of the batch (zeroed anyway) or, in a batch of
    padding only, slot 0's row back to itself. Device ops only (no boolean indexing).
    """
    if pending is None or slots.numel() == 0:
        return
    top = slots.max()
    target = torch.where(slots >= 0, slots, top.clamp(min=0)).long()
    keep = (slots < 0) & (top < 0)  # padding-only batch: write slot 0's row back unchanged
    pending[target, 0] = torch.where(keep[:, None], pending[target, 0], 0.0)


def gdn_prefill(
    kernels,
    geometry: GDNGeometry,
    weights: GDNWeights,
    state: GDNLayerState,
    x: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    meta: GDNPrefillMeta,
) -> torch.Tensor:
    """Prompt chunks, ``x[Tp, C]``, ``b``/``a`` ``[Tp, Hv]`` (the prefill tokens only) -> ``o[Tp, Hv, Dv]``.

    Varlen conv (initial history where ``has_initial_state``), chunked delta rule writing each chunk's
    final state to its slot, then ``pending[s, 0]`` becomes an identity token. With pending tokens and
    ``meta.context_lens``: a sequence continuing from a snapshot first commits its pending tokens
    (:func:`~atom_models.gdn_snapshot.resume_pending`, where ``meta.resume_pending``), and each slot records
    ``pending_pos = context_len + chunk_len - 1`` (the identity token's position).
    """
    track = state.pending_pos is not None and meta.context_lens is not None
    if track and meta.resume_pending:
        resume_pending(
            kernels, geometry, weights, state, meta.state_indices, meta.has_initial_state, meta.context_lens
        )
    xc = kernels.causal_conv1d_varlen(
        x,
        weights.conv_weight,
        weights.conv_bias,
        meta.cu_seqlens,
        state.conv,
        meta.state_indices,
        meta.has_initial_state,
        activation="silu",
    )
    q, k, v = geometry.split_qkv(xc)
    g, beta = kernels.gdn_gating(weights.A_log, a, weights.dt_bias, b)
    o = kernels.gated_delta_rule_chunked(
        q,
        k,
        v,
        g,
        beta,
        meta.cu_seqlens,
        state.ssm,
        meta.state_indices,
        meta.has_initial_state,
        scale=geometry.scale,
        use_qk_l2norm=True,
    )
    reset_pending(state.pending, meta.state_indices)
    if track:
        lens = meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]
        put_positions(state.pending_pos, meta.state_indices, meta.context_lens + lens - 1)
    return o


def gdn_decode(
    kernels,
    geometry: GDNGeometry,
    weights: GDNWeights,
    state: GDNLayerState,
    x: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    meta: GDNDecodeMeta,
) -> torch.Tensor:
    """One token per sequence, ``x[N, C]``, ``b``/``a`` ``[N, Hv]`` -> ``o[N, Hv, Dv]``: conv update and
    recurrent rule (gating fused in) in place in each slot; ``pending[s, 0]`` becomes an identity token."""
    n = meta.num_seqs
    xc = kernels.causal_conv1d_update(
        x.view(n, 1, -1),
        weights.conv_weight,
        weights.conv_bias,
        state.conv,
        meta.state_indices,
        None,
        activation="silu",
    )
    q, k, v = geometry.split_qkv(xc)
    o = kernels.gated_delta_rule_recurrent(
        q,
        k,
        v,
        a.view(n, 1, -1),  # raw gate inputs: the op computes g and beta (A_log, dt_bias given)
        b.view(n, 1, -1),
        state.ssm,
        meta.state_indices,
        scale=geometry.scale,
        use_qk_l2norm=True,
        A_log=weights.A_log,
        dt_bias=weights.dt_bias,
    )
    reset_pending(state.pending, meta.state_indices)
    if state.pending_pos is not None:  # the identity token sits at this token's position, one further
        slots = meta.state_indices
        put_positions(state.pending_pos, slots, state.pending_pos.view(-1)[slots.clamp(min=0).long()] + 1)
    return o.view(n, geometry.num_v_heads, geometry.head_v_dim)


def gdn_verify(
    kernels,
    geometry: GDNGeometry,
    weights: GDNWeights,
    state: GDNLayerState,
    x: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    meta: GDNVerifyMeta,
) -> torch.Tensor:
    """``N`` verifications of ``Q`` tokens, ``x[N * Q, C]``, ``b``/``a`` ``[N * Q, Hv]`` in (sequence, token)
    order -> ``o[N * Q, Hv, Dv]``.

    Conv update resuming at ``num_accepted`` in the rolled history; ``gated_delta_rule_verify`` (gating
    fused in) commits ``num_accepted`` pending tokens into the slot's state, verifies these tokens without
    storing their states and stashes them as the new pending tokens; ``pending_pos`` (where kept) moves
    on by ``num_accepted`` to the first of them.
    """
    if state.pending is None:
        raise ValueError("gdn_verify: the layer state has no pending tokens (num_speculative_tokens = 0)")
    n, ql = meta.num_seqs, meta.q_len
    xc = kernels.causal_conv1d_update(
        x.view(n, ql, -1),
        weights.conv_weight,
        weights.conv_bias,
        state.conv,
        meta.state_indices,
        meta.num_accepted,
        activation="silu",
    )
    q, k, v = geometry.split_qkv(xc)
    o = kernels.gated_delta_rule_verify(
        q,
        k,
        v,
        a.view(n, ql, -1),  # raw gate inputs: the op computes g and beta (A_log, dt_bias given)
        b.view(n, ql, -1),
        state.ssm,
        state.pending,
        meta.state_indices,
        meta.num_accepted,
        scale=geometry.scale,
        use_qk_l2norm=True,
        A_log=weights.A_log,
        dt_bias=weights.dt_bias,
        pending_pos=state.pending_pos,  # advanced by num_accepted inside the op (no launch of its own)
    )
    return o.view(n * ql, geometry.num_v_heads, geometry.head_v_dim)


def gdn_forward(
    kernels,
    geometry: GDNGeometry,
    weights: GDNWeights,
    state: GDNLayerState,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    step: GDNStepMeta,
) -> torch.Tensor:
    """The flat batch ``mixed_qkv[T, C]``, ``b``/``a`` ``[T, Hv]`` -> ``o[T, Hv, Dv]`` (pre-norm output).

    Each part of ``step`` takes its rows (a slice, or a gather by index), runs its function and puts its
    outputs back; rows of no part stay zero. One extra scratch row receives the outputs of padding tokens.
    A step that is one decode or one in-order verify part over all ``T`` rows (a uniform decode / verify
    batch) returns that part's output as is, without the zeroed buffer and its copy.

    ``step.snapshots`` (prefix caching): whole-slot copies of this layer's state before the parts run and
    after they ran, each one ``kernels.copy_rows`` call through a :class:`~atom_models.gdn_snapshot.SlotCopier`
    of the layer, built for the step (host work: a step with snapshots is not capturable). A runner that
    copies at step level instead (one copier over every GDN layer, as the vLLM plugin does) leaves
    ``step.snapshots`` unset.
    """
    snaps = step.snapshots
    copier = SlotCopier(kernels, [state]) if snaps is not None else None
    if copier is not None:
        copier.copy(snaps.before_src, snaps.before_dst)
    out = _forward_parts(kernels, geometry, weights, state, mixed_qkv, b, a, step)
    if copier is not None:
        copier.copy(snaps.after_src, snaps.after_dst)
    return out


def _forward_parts(kernels, geometry, weights, state, mixed_qkv, b, a, step: GDNStepMeta) -> torch.Tensor:
    t = mixed_qkv.shape[0]
    args = (kernels, geometry, weights, state)
    if step.prefill is None and len(step.decodes) + len(step.verifies) == 1:
        if step.decodes and step.decodes[0].token_start == 0 and step.decodes[0].num_seqs == t:
            return gdn_decode(*args, mixed_qkv, b, a, step.decodes[0])
        ver = step.verifies[0] if step.verifies else None
        if (
            ver is not None
            and ver.gather_index is None
            and ver.token_start == 0
            and ver.num_seqs * ver.q_len == t
        ):
            return gdn_verify(*args, mixed_qkv, b, a, ver)
    out = mixed_qkv.new_zeros(t + 1, geometry.num_v_heads, geometry.head_v_dim)
    pre = step.prefill
    if pre is not None and pre.num_tokens > 0:
        if pre.token_index is None:
            rows = slice(pre.token_start, pre.token_start + pre.num_tokens)
            out[rows] = gdn_prefill(*args, mixed_qkv[rows], b[rows], a[rows], pre)
        else:
            ti = pre.token_index
            o = gdn_prefill(*args, mixed_qkv[ti], b[ti], a[ti], pre)
            out.index_copy_(0, ti, o)
    for dec in step.decodes:
        if dec.num_seqs > 0:
            rows = slice(dec.token_start, dec.token_start + dec.num_seqs)
            out[rows] = gdn_decode(*args, mixed_qkv[rows], b[rows], a[rows], dec)
    for ver in step.verifies:
        if ver.num_seqs == 0:
            continue
        if ver.gather_index is None:
            rows = slice(ver.token_start, ver.token_start + ver.num_seqs * ver.q_len)
            out[rows] = gdn_verify(*args, mixed_qkv[rows], b[rows], a[rows], ver)
        else:
            gi = ver.gather_index
            o = gdn_verify(*args, mixed_qkv[gi], b[gi], a[gi], ver)
            out.index_copy_(0, torch.where(ver.scatter_index < 0, t, ver.scatter_index), o)
    return out[:t]
