"""Reference gated delta rule, float32 math, state layout ``ssm_state[S, Hv, Dv, Dk]`` ("vk").

Per token and value head (key head ``h // (Hv // Hk)``)::

    S_t = S_{t-1} * exp(g_t)
    S_t = S_t + beta_t * (v_t - S_t k_t) k_t^T      # S: [Dv, Dk], k: [Dk], v: [Dv]
    o_t = S_t q_t * scale

with q, k L2-normalised first when ``use_qk_l2norm``. The recurrent and verify ops can fuse the gating: given
``A_log`` and ``dt_bias``, their ``g`` and ``beta`` arguments are the raw gate inputs ``a`` and ``b`` and the
op applies :func:`~atom_kernels.ops.gdn_gating.reference.gdn_gating` first (bit for bit the unfused pair). The chunked form computes the same thing for
chunks of ``chunk_size`` tokens with the WY/UT transform (as fla's ``chunk_gated_delta_rule`` and
transformers' ``torch_chunk_gated_delta_rule``).
"""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import check_cu_seqlens_values, check_num_accepted_values, check_slot_values
from atom_kernels.ops.gated_delta_rule.checks import (
    check_gated_delta_rule_chunked,
    check_gated_delta_rule_recurrent,
    check_gated_delta_rule_verify,
)
from atom_kernels.ops.gdn_gating.reference import gdn_gating
from atom_kernels.ops.l2norm.reference import l2norm_f32


def _gate_values(
    g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(g, beta)`` ``[N, Q, Hv]``: the given ones, or (fused gating) ``gdn_gating`` of the raw
    ``a = g``, ``b = beta``."""
    if A_log is None:
        return g.float(), beta.float()
    shape = g.shape
    g32, b32 = gdn_gating(A_log, g.reshape(-1, shape[-1]), dt_bias, beta.reshape(-1, shape[-1]))
    return g32.view(shape), b32.view(shape)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q (scaled), k with the key heads repeated to the value heads (head dim -2)."""
    # contiguous: the L2-norm sum must round the same for strided inputs (the conv output is channel-major)
    # and for the contiguous pending tokens that gated_delta_rule_verify replays.
    q32, k32 = q.float().contiguous(), k.float().contiguous()
    if use_qk_l2norm:
        q32, k32 = l2norm_f32(q32), l2norm_f32(k32)
    group = num_v_heads // q.shape[-2]
    if group > 1:
        q32, k32 = q32.repeat_interleave(group, dim=-2), k32.repeat_interleave(group, dim=-2)
    return q32 * scale, k32


def _read_states(ssm_state: torch.Tensor, slots: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    """``[N, Hv, Dv, Dk]`` float32 copies of the slots' states; zeros where ``use`` is False."""
    states = ssm_state[slots.long().clamp(min=0)].float()
    return states * use[:, None, None, None].to(states.dtype)


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Prefill of a flat varlen batch, chunked; vectorised over sequences and heads.

    Args:
        q, k: ``[T, Hk, Dk]``; v: ``[T, Hv, Dv]``; g (log decay, <= 0), beta: ``[T, Hv]``.
        cu_seqlens: ``[N+1]`` int32 offsets.
        ssm_state: ``[S, Hv, Dv, Dk]`` float32/bf16, updated in place.
        state_indices: ``[N]`` int32 slots (< 0: padding; zero initial state, nothing written).
        has_initial_state: ``[N]`` bool; where False the initial state is zero.
        scale: query scale (usually ``Dk ** -0.5``).
        use_qk_l2norm: L2-normalise q and k (eps 1e-6) first.
        chunk_size: tokens per chunk.

    Returns:
        ``o [T, Hv, Dv]`` in q.dtype; each sequence's final state is written to ``ssm_state[slot]``.
    """
    check_gated_delta_rule_chunked(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens,
        ssm_state,
        state_indices,
        has_initial_state,
        scale,
        use_qk_l2norm,
        chunk_size,
    )
    op = "gated_delta_rule_chunked"
    check_slot_values(op, "state_indices", state_indices, ssm_state.shape[0])
    total, num_v_heads, dv = v.shape
    num_seqs = state_indices.shape[0]
    device = q.device
    check_cu_seqlens_values(op, cu_seqlens, total)
    offsets = cu_seqlens.long()
    lens = offsets[1:] - offsets[:-1]
    max_len = int(lens.max()) if num_seqs > 0 else 0
    chunk = chunk_size
    padded = max(chunk, -(-max_len // chunk) * chunk)
    num_chunks = padded // chunk

    # Scatter the flat tokens into [N, padded] (zero padding at the end of each sequence: with k = 0,
    # v = 0, beta = 0 and g = 0 padded tokens leave the state unchanged).
    seq_id = torch.repeat_interleave(torch.arange(num_seqs, device=device), lens)
    pos = torch.arange(total, device=device) - offsets[seq_id]
    q32, k32 = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)

    def pad(x: torch.Tensor) -> torch.Tensor:  # [T, Hv, ...] -> [N, Hv, num_chunks, chunk, ...]
        out = x.new_zeros((num_seqs, padded, *x.shape[1:]))
        out[seq_id, pos] = x
        out = out.movedim(1, 2)  # [N, Hv, padded, ...]
        return out.reshape(num_seqs, num_v_heads, num_chunks, chunk, *x.shape[2:])

    qc, kc, vc = pad(q32), pad(k32), pad(v.float())
    gc, bc = pad(g.float()), pad(beta.float())  # [N, Hv, nC, C]

    v_beta = vc * bc[..., None]
    k_beta = kc * bc[..., None]
    cum = gc.cumsum(dim=-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., C, C]
    # UT transform: (I + strictly_lower(beta K K^T * decay)) [u | w] = [beta V | beta K exp(cum)].
    system = (k_beta @ kc.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay  # intra-chunk causal scores, diagonal included
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, Hv, nC, 1, 1]

    # Internal state in "kv" layout [N, Hv, Dk, Dv]; the pool stores its transpose.
    use_init = has_initial_state & (state_indices >= 0)
    state = _read_states(ssm_state, state_indices, use_init).transpose(-1, -2)
    out = torch.empty_like(vc)
    for i in range(num_chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new

    keep = (state_indices >= 0).nonzero().squeeze(1)
    ssm_state[state_indices.long()[keep]] = state[keep].transpose(-1, -2).to(ssm_state.dtype)
    out = out.reshape(num_seqs, num_v_heads, padded, dv).movedim(2, 1)  # [N, padded, Hv, Dv]
    return out[seq_id, pos].to(q.dtype)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode: Q tokens per sequence from its slot's state, the final state written back to the slot.

    Args:
        q, k: ``[N, Q, Hk, Dk]``; v: ``[N, Q, Hv, Dv]``; g, beta: ``[N, Q, Hv]`` (log decay, write
            strength; with fused gating the raw gate inputs ``a``, ``b``).
        ssm_state: ``[S, Hv, Dv, Dk]`` float32/bf16, updated in place.
        state_indices: ``[N]`` int32 slots (< 0: padding row, zero state, nothing written).
        scale: query scale; use_qk_l2norm: L2-normalise q and k first.
        A_log, dt_bias: ``[Hv]``, both or neither. Given: fused gating, ``g, beta = gdn_gating(A_log, g,
            dt_bias, beta)`` (float32) before the rule.

    Returns:
        ``o [N, Q, Hv, Dv]`` in q.dtype. The state is carried in float32 between the tokens of a call
        and rounded once, when stored.
    """
    check_gated_delta_rule_recurrent(
        q, k, v, g, beta, ssm_state, state_indices, scale, use_qk_l2norm, A_log, dt_bias
    )
    op = "gated_delta_rule_recurrent"
    q_len, num_v_heads = v.shape[1], v.shape[2]
    check_slot_values(op, "state_indices", state_indices, ssm_state.shape[0])
    slots = state_indices.long()
    valid = slots >= 0
    state = _read_states(ssm_state, slots, valid)  # [N, Hv, Dv, Dk]
    q32, k32 = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)
    v32 = v.float()
    g32, b32 = _gate_values(g, beta, A_log, dt_bias)
    out = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    for j in range(q_len):
        state, _ = _delta_step(state, k32[:, j], v32[:, j], g32[:, j], b32[:, j])
        out[:, j] = (state @ q32[:, j, :, :, None]).squeeze(-1)
    keep = valid.nonzero().squeeze(1)
    ssm_state[slots[keep]] = state[keep].to(ssm_state.dtype)
    return out.to(q.dtype)


def _delta_step(
    state: torch.Tensor, k32: torch.Tensor, v32: torch.Tensor, g32: torch.Tensor, b32: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the rule on ``state[N, Hv, Dv, Dk]`` (k already normalised and repeated to Hv).

    Returns the new state and the token's update coefficients ``u = beta (v - (state * exp(g)) k)``
    ``[N, Hv, Dv]`` (the new state is ``state * exp(g) + u k^T``)."""
    state = state * g32.exp()[..., None, None]
    delta = b32[..., None] * (v32 - (state @ k32[..., None]).squeeze(-1))  # [N, Hv, Dv]
    return state + delta[..., :, None] * k32[..., None, :], delta


def gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    pending: torch.Tensor,
    state_indices: torch.Tensor,
    num_commit: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    pending_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """MTP verify with deferred commit: commit the accepted pending tokens, verify Q new ones, stash them.

    Args:
        q, k: ``[N, Q, Hk, Dk]``; v: ``[N, Q, Hv, Dv]``; g, beta: ``[N, Q, Hv]`` (log decay, write
            strength; with fused gating the raw gate inputs ``a``, ``b``).
        ssm_state: ``[S, Hv, Dv, Dk]`` float32/bf16: the committed state of each slot, updated in place.
        pending: ``[S, R, P]`` float32, ``P = Hk*Dk + Hv*Dv + Hv``: per slot the previous verify step's
            tokens ``[k (raw) | u | g]``, ``u = beta (v - (S exp(g)) k)`` the token's update
            coefficients; overwritten with this step's.
        state_indices: ``[N]`` int32 slots (< 0: padding row, zero state, nothing read or written).
        num_commit: ``[N]`` int32 in ``[0, R]``: how many pending tokens to commit first (the tokens of
            the previous step that were accepted; 0 commits nothing).
        scale: query scale; use_qk_l2norm: L2-normalise q and k (also the pending k on replay).
        A_log, dt_bias: ``[Hv]``, both or neither. Given: fused gating, ``g, beta = gdn_gating(A_log, g,
            dt_bias, beta)`` (float32) before the rule; the stashed ``g`` is the computed one.
        pending_pos: ``[S, 1]`` int32 or None: per slot the sequence position of pending token 0; each real
            row's slot advances by its ``num_commit`` (the first of the stashed tokens is that many positions
            after the first of the committed ones).

    Returns:
        ``o [N, Q, Hv, Dv]`` in q.dtype. No per-token state is stored: the committed state is written
        once (rounded to the pool dtype) and the verify continues from that rounded value. Committing a
        token is ``S = S exp(g) + u k^T``: no reduction over the state, so committing is cheap.
    """
    check_gated_delta_rule_verify(
        q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm, A_log, dt_bias,
        pending_pos,
    )  # fmt: skip
    op = "gated_delta_rule_verify"
    num_seqs, q_len, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[2], v.shape[3]
    check_slot_values(op, "state_indices", state_indices, ssm_state.shape[0])
    r = pending.shape[1]
    check_num_accepted_values(op, num_commit, r, f"R={r}", low=0, name="num_commit")
    slots = state_indices.long()
    valid = slots >= 0
    safe = slots.clamp(min=0)
    state = _read_states(ssm_state, safe, valid)  # [N, Hv, Dv, Dk] float32

    # 1. commit the first num_commit pending tokens of each slot: S = S exp(g) + u k^T.
    old = pending[safe]  # [N, R, P] (a copy: the stash below cannot disturb it)
    kd, vd = num_k_heads * dk, num_v_heads * dv
    pk = old[..., :kd].view(num_seqs, -1, num_k_heads, dk)
    pu = old[..., kd : kd + vd].view(num_seqs, -1, num_v_heads, dv)
    pg = old[..., kd + vd :]
    _, pk32 = _prepare_qk(pk, pk, num_v_heads, 1.0, use_qk_l2norm)
    n_commit = num_commit.long() * valid
    for j in range(int(n_commit.max()) if num_seqs > 0 else 0):
        stepped = state * pg[:, j].exp()[..., None, None]
        stepped = stepped + pu[:, j, :, :, None] * pk32[:, j, :, None, :]
        state = torch.where((j < n_commit)[:, None, None, None], stepped, state)
    keep = valid.nonzero().squeeze(1)
    ssm_state[slots[keep]] = state[keep].to(ssm_state.dtype)
    state = state.to(ssm_state.dtype).float()  # continue from the stored (rounded) value

    # 2. verify the Q new tokens; no state is stored, only each token's u.
    q32, k32 = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)
    v32 = v.float()
    g32, b32 = _gate_values(g, beta, A_log, dt_bias)
    out = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    us = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    for j in range(q_len):
        state, us[:, j] = _delta_step(state, k32[:, j], v32[:, j], g32[:, j], b32[:, j])
        out[:, j] = (state @ q32[:, j, :, :, None]).squeeze(-1)

    # 3. stash this step's tokens for the next step's commit.
    new = torch.cat([k.float().flatten(2), us.flatten(2), g32], dim=-1)  # [N, Q, P]
    pending[slots[keep], :q_len] = new[keep]
    if pending_pos is not None:
        pending_pos[slots[keep], 0] += num_commit[keep].to(pending_pos.dtype)
    return out.to(q.dtype)
