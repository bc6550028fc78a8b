"""Gated delta rule decode and MTP verify for CPUs: the reference's semantics, the state read a few times.

The reference steps the ``[N, Hv, Dv, Dk]`` state token by token (about five full passes over the state
per token). Here the ``Q`` tokens of a call are applied in closed form from the state ``S`` they start
from (``cum_j = g_0 + ... + g_j``, q already scaled, k normalised)::

    u_j = beta_j (v_j - e^{cum_j} S k_j - sum_{l<j} e^{cum_j - cum_l} (k_l . k_j) u_l)
    o_j = e^{cum_j} S q_j + sum_{l<=j} e^{cum_j - cum_l} (k_l . q_j) u_l
    S_Q = e^{cum_{Q-1}} S + sum_l e^{cum_{Q-1} - cum_l} u_l k_l^T

so a call reads the state once for ``S [k | q]`` (one matmul) and once more, with one write, for the
new state (a scale and a rank-``Q`` update); everything else is ``[N, Q, Hv, Dv]``-sized. The verify's
commit of the pending tokens is the last line with the stashed ``u`` (tokens past ``num_commit`` get
``g = 0``, ``u = 0``, ``k = 0``). Same float32 math as the reference up to the order of the sums
(tolerances in the conformance tests); rounding points as the reference.

Three ways through the state pool:

- float32 pool (vLLM's CPU default, no rounding point between the commit and the verify) and at most
  :data:`.cpu_native.MAX_TOKENS` tokens, where a C compiler builds :mod:`.cpu_native`: the whole step in
  one C pass over each state row (commit, the products with ``[k | q]``, the tokens' outputs and ``u``,
  decode's advance, the verify's stash of ``u``). A decode or verify with float32 or bf16 tokens and
  gates whose last dim is contiguous runs as one C call (:mod:`.cpu_native_verify`: the range checks,
  the gating, the inputs' preparation, the commit's and the stash's pending rows, then the pass);
  otherwise the per-head coefficients
  (:func:`_token_coefs`), the pending gathers and the rest of the stash are torch ops here. Measured 2.3-3.7x the per-slot torch
  form's speed at N = 256, 1.6-2.4x at N = 16 (one thread, ``benchmarks/cpu_gdn_verify.py``);
- float32 pool otherwise: per slot, in place, ``S *= e^C``, ``S += U K``, ``S [k | q]`` (three ops on a
  few hundred KiB that stay in cache; nothing gathered or scattered: measured 2.5-3x faster than the
  grouped way on 2 cores);
- any other pool: float32 copies of groups of about :data:`STATE_BLOCK_BYTES` of state (gathered,
  updated, rounded and stored, then the verify continues from the rounded value, as the reference).
  Groups keep the copies cache-sized and their buffers reusable from the heap (a fresh multi-MiB
  buffer per call pays its page faults on every call, more than the arithmetic).
"""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import check_num_accepted_values, check_slot_values
from atom_kernels.ops.gated_delta_rule import cpu_native, cpu_native_verify
from atom_kernels.ops.gated_delta_rule.checks import (
    check_gated_delta_rule_recurrent,
    check_gated_delta_rule_verify,
)
from atom_kernels.ops.gated_delta_rule.reference import _gate_values, _prepare_qk

STATE_BLOCK_BYTES = 4 << 20
"""float32 state bytes of one group of sequences (at least one sequence per group)."""


def _groups(num_seqs: int, state_shape: torch.Size) -> list[tuple[int, int]]:
    """``(start, end)`` row ranges of about :data:`STATE_BLOCK_BYTES` of float32 state each."""
    per_seq = max(1, state_shape[1] * state_shape[2] * state_shape[3] * 4)
    step = max(1, STATE_BLOCK_BYTES // per_seq)
    return [(i, min(i + step, num_seqs)) for i in range(0, num_seqs, step)]


def _gather_states(ssm_state: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, all_valid: bool):
    """float32 ``[N, Hv, Dv, Dk]`` copies of the slots' states (padding rows: zeros), owned by the caller."""
    flat = ssm_state.view(ssm_state.shape[0], -1) if ssm_state.is_contiguous() else ssm_state
    states = flat.index_select(0, slots.clamp(min=0)).view(slots.shape[0], *ssm_state.shape[1:])
    states = states.float() if states.dtype != torch.float32 else states
    if not all_valid:
        states.mul_(valid[:, None, None, None].to(states.dtype))
    return states


def _store_states(ssm_state: torch.Tensor, slots: torch.Tensor, states: torch.Tensor, keep) -> None:
    """``ssm_state[slots[n]] = states[n]`` (rounded to the pool dtype) for the real rows ``keep``."""
    if keep is None:
        ssm_state.index_copy_(0, slots, states.to(ssm_state.dtype))
    else:
        ssm_state[slots[keep]] = states[keep].to(ssm_state.dtype)


def _update_factors(
    k32: torch.Tensor, u: torch.Tensor, g32: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(e^C [N, Hv], U [N, Hv, Dv, Q], K [N, Hv, Q, Dk])`` with ``e^C S + U K`` the state after the Q
    tokens (``U = e^{C - cum_l} u_l`` stacked, ``cum = cumsum(g)``, ``C = cum_{Q-1}``).

    k32 ``[N, Q, Hv, Dk]``; u ``[N, Q, Hv, Dv]``; g32 ``[N, Q, Hv]``."""
    cum = g32.cumsum(1)
    total = cum[:, -1]  # [N, Hv]
    coef = (total[:, None] - cum).exp()  # [N, Q, Hv]
    uw = (u * coef[..., None]).permute(0, 2, 3, 1).contiguous()  # [N, Hv, Dv, Q]
    kk = k32.permute(0, 2, 1, 3).contiguous()  # [N, Hv, Q, Dk]
    return total.exp(), uw, kk


def _decay_update(state: torch.Tensor, k32: torch.Tensor, u: torch.Tensor, g32: torch.Tensor) -> torch.Tensor:
    """In place: ``state = e^{C} state + sum_l e^{C - cum_l} u_l k_l^T`` (:func:`_update_factors`) for a
    batch ``state [N, Hv, Dv, Dk]`` float32."""
    n, q_len, hv, dk = k32.shape
    decay, uw, kk = _update_factors(k32, u, g32)
    state.mul_(decay[..., None, None])
    state.view(n * hv, -1, dk).baddbmm_(uw.view(n * hv, -1, q_len), kk.view(n * hv, q_len, dk))
    return state


def _in_place(ssm_state: torch.Tensor) -> bool:
    """Whether the per-slot in-place path applies: a float32 pool (no rounding point between the commit
    and the verify) whose slot states are contiguous."""
    return ssm_state.dtype == torch.float32 and ssm_state[0].is_contiguous() if ssm_state.shape[0] else False


def _token_matrix(q32: torch.Tensor, k32: torch.Tensor) -> torch.Tensor:
    """``[k_0 .. k_{Q-1} | q_0 .. q_{Q-1}]`` as ``[N, Hv, Dk, 2Q]`` (contiguous)."""
    return torch.cat([k32, q32], dim=1).permute(0, 2, 3, 1).contiguous()


def _update_rows(
    ssm_state: torch.Tensor,
    rows: list[int],
    decay: torch.Tensor,
    uw: torch.Tensor,
    kk: torch.Tensor,
    x: torch.Tensor | None = None,
    products: torch.Tensor | None = None,
) -> None:
    """For each real slot ``rows[i] >= 0``, in place in the float32 pool: ``S = decay[i] S + uw[i] kk[i]``
    (:func:`_update_factors`), then, given ``x``, ``products[i] = S x[i]``. One slot's state (a few hundred
    KiB) stays in cache across its three ops, and nothing is gathered or scattered."""
    # per-row views made once (unbind), not per slot by indexing: the loop is host-bound at small shapes
    decays, uws, kks = decay[:, :, None, None].unbind(0), uw.unbind(0), kk.unbind(0)
    xs, outs = (x.unbind(0), products.unbind(0)) if x is not None else (None, None)
    for i, slot in enumerate(rows):
        if slot < 0:
            continue
        state = ssm_state[slot]  # [Hv, Dv, Dk]
        state.mul_(decays[i])
        state.baddbmm_(uws[i], kks[i])
        if xs is not None:
            torch.matmul(state, xs[i], out=outs[i])


def _state_products(state: torch.Tensor, q32: torch.Tensor, k32: torch.Tensor) -> torch.Tensor:
    """``S [k_0 .. k_{Q-1} | q_0 .. q_{Q-1}]``: ``[N, Hv, Dv, 2Q]`` (state ``[N, Hv, Dv, Dk]``, q32 / k32
    ``[N, Q, Hv, Dk]``); the only read of the state the tokens need."""
    return torch.matmul(state, torch.cat([k32, q32], dim=1).permute(0, 2, 3, 1))


def _apply_tokens(
    sx: torch.Tensor,
    q32: torch.Tensor,
    k32: torch.Tensor,
    v32: torch.Tensor,
    g32: torch.Tensor,
    b32: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``o [N, Q, Hv, Dv]`` and update coefficients ``u [N, Q, Hv, Dv]`` of Q tokens run from a
    state ``S`` given by ``sx = S [k | q]`` (:func:`_state_products`); q32 scaled, k32 normalised."""
    n, q_len, hv, dk = k32.shape
    dv = v32.shape[-1]
    sk = sx[..., :q_len].permute(0, 3, 1, 2)  # [N, Q, Hv, Dv]
    sq = sx[..., q_len:].permute(0, 3, 1, 2)
    cum = g32.cumsum(1)  # [N, Q, Hv]
    ecum = cum.exp()
    kh = k32.transpose(1, 2)  # [N, Hv, Q, Dk]
    kk = torch.matmul(kh, kh.transpose(-1, -2))  # [N, Hv, Q(l), Q(j)]: k_l . k_j
    kq = torch.matmul(kh, q32.transpose(1, 2).transpose(-1, -2))  # [N, Hv, Q(l), Q(j)]: k_l . q_j
    u = torch.empty(n, q_len, hv, dv, dtype=torch.float32, device=sx.device)
    out = torch.empty_like(u)
    for j in range(q_len):
        acc_u = ecum[:, j, :, None] * sk[:, j]
        acc_o = ecum[:, j, :, None] * sq[:, j]
        for ell in range(j):
            w = (cum[:, j] - cum[:, ell]).exp()  # [N, Hv]
            acc_u = acc_u + (w * kk[:, :, ell, j])[..., None] * u[:, ell]
            acc_o = acc_o + (w * kq[:, :, ell, j])[..., None] * u[:, ell]
        u[:, j] = b32[:, j, :, None] * (v32[:, j] - acc_u)
        out[:, j] = acc_o + kq[:, :, j, j][..., None] * u[:, j]
    return out, u


def _slots(state_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The slots as int64, which rows are real (slot >= 0), and whether all are (one host read)."""
    slots = state_indices.long()
    valid = slots >= 0
    return slots, valid, bool(valid.all())


def _float_tokens(
    q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias, repeat=True
) -> tuple[torch.Tensor, ...]:
    """The new tokens in float32 as both ops use them: q (scaled) and k (L2-normalised when asked) with the
    key heads repeated to the value heads (``repeat``; else per key head), v, and the gates ``g``, ``beta``
    (computed from the raw ``a``, ``b`` under fused gating)."""
    q32, k32 = _prepare_qk(q, k, v.shape[2] if repeat else k.shape[2], scale, use_qk_l2norm)
    g32, b32 = _gate_values(g, beta, A_log, dt_bias)
    return q32, k32, v.float(), g32, b32


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
    """:func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_recurrent` (same contract)."""
    check_gated_delta_rule_recurrent(
        q, k, v, g, beta, ssm_state, state_indices, scale, use_qk_l2norm, A_log, dt_bias
    )
    if cpu_native_verify.usable(q, k, v, g, beta, ssm_state, None, A_log, dt_bias, None):
        return cpu_native_verify.decode_step(
            q, k, v, g, beta, ssm_state, state_indices, scale, use_qk_l2norm, A_log, dt_bias
        )
    check_slot_values("gated_delta_rule_recurrent", "state_indices", state_indices, ssm_state.shape[0])
    num_v_heads = v.shape[2]
    if cpu_native.usable(ssm_state, q.shape[1]):
        slots = state_indices.long()
        q32, k32, v32, g32, b32 = _float_tokens(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias, False)
        cum = g32.cumsum(1)  # [N, Q, Hv]
        advance = cum[:, -1].exp(), (cum[:, -1:] - cum).exp()  # e^C, e^{C - cum_j}: S = e^C S + sum U K
        out = cpu_native.gdn_pass(ssm_state, slots, q32, k32, v32, b32, *_token_coefs(q32, k32, cum),
                                     advance=advance)  # fmt: skip
        return out.to(q.dtype)
    slots, valid, all_valid = _slots(state_indices)
    q32, k32, v32, g32, b32 = _float_tokens(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias)
    if _in_place(ssm_state):
        rows = slots.tolist()
        x = _token_matrix(q32, k32)
        sx = torch.zeros(
            x.shape[0], num_v_heads, v.shape[3], x.shape[-1], dtype=torch.float32, device=q.device
        )
        for slot, x_i, sx_i in zip(rows, x.unbind(0), sx.unbind(0)):
            if slot >= 0:
                torch.matmul(ssm_state[slot], x_i, out=sx_i)
        out, u = _apply_tokens(sx, q32, k32, v32, g32, b32)
        _update_rows(ssm_state, rows, *_update_factors(k32, u, g32))
        return out.to(q.dtype)
    out = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    for lo, hi in _groups(slots.shape[0], ssm_state.shape):
        rows = slice(lo, hi)
        keep = None if all_valid else valid[rows].nonzero().squeeze(1)
        state = _gather_states(ssm_state, slots[rows], valid[rows], all_valid)
        sx = _state_products(state, q32[rows], k32[rows])
        out[rows], u = _apply_tokens(sx, q32[rows], k32[rows], v32[rows], g32[rows], b32[rows])
        _store_states(ssm_state, slots[rows], _decay_update(state, k32[rows], u, g32[rows]), keep)
    return out.to(q.dtype)


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
    """:func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_verify` (same contract)."""
    check_gated_delta_rule_verify(
        q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm, A_log, dt_bias,
        pending_pos,
    )  # fmt: skip
    op = "gated_delta_rule_verify"
    num_seqs, q_len, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[2], v.shape[3]
    if cpu_native_verify.usable(q, k, v, g, beta, ssm_state, pending, A_log, dt_bias, pending_pos):
        return cpu_native_verify.verify_step(
            q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm, A_log,
            dt_bias, pending_pos,
        )  # fmt: skip
    check_slot_values(op, "state_indices", state_indices, ssm_state.shape[0])
    r = pending.shape[1]
    check_num_accepted_values(op, num_commit, r, f"R={r}", low=0, name="num_commit")
    if cpu_native.usable(ssm_state, q_len) and pending.stride(-1) == 1:
        return _verify_native(
            q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm, A_log,
            dt_bias, pending_pos,
        )  # fmt: skip
    slots, valid, all_valid = _slots(state_indices)
    safe = slots.clamp(min=0)
    kd, vd = num_k_heads * dk, num_v_heads * dv
    # Pending tokens: the first num_commit of each slot are committed, the rest get g = 0, u = 0.
    old = pending[safe]  # [N, R, P] (a copy: the stash below cannot disturb it)
    pk = old[..., :kd].view(num_seqs, r, num_k_heads, dk)
    _, pk32 = _prepare_qk(pk, pk, num_v_heads, 1.0, use_qk_l2norm)
    take = torch.arange(r, device=q.device)[None, :] < (num_commit.long() * valid)[:, None]  # [N, R]
    pk32 = torch.where(take[..., None, None], pk32, 0.0)  # tokens not committed may hold anything
    pu = torch.where(take[..., None], old[..., kd : kd + vd], 0.0).view(num_seqs, r, num_v_heads, dv)
    pg = torch.where(take[..., None], old[..., kd + vd :], 0.0)
    q32, k32, v32, g32, b32 = _float_tokens(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias)
    if _in_place(ssm_state):
        # 1 + 2 on each slot's state in place: commit, then the products the verify needs.
        rows = slots.tolist()
        x = _token_matrix(q32, k32)
        sx = torch.zeros(num_seqs, num_v_heads, dv, 2 * q_len, dtype=torch.float32, device=q.device)
        _update_rows(ssm_state, rows, *_update_factors(pk32, pu, pg), x=x, products=sx)
    else:
        sx = _grouped_commit(ssm_state, slots, valid, all_valid, pk32, pu, pg, q32, k32, q_len)
    # 3. verify the Q new tokens (all groups at once); nothing stored but each token's u.
    out, us = _apply_tokens(sx, q32, k32, v32, g32, b32)

    # 4. stash this step's tokens for the next step's commit.
    new = torch.cat([k.float().flatten(2), us.flatten(2), g32], dim=-1)  # [N, Q, P]
    keep = None if all_valid else valid.nonzero().squeeze(1)
    if keep is None:
        pending[slots, :q_len] = new
    else:
        pending[slots[keep], :q_len] = new[keep]
    if pending_pos is not None:
        rows, commit = (slots, num_commit) if keep is None else (slots[keep], num_commit[keep])
        pending_pos[rows, 0] += commit.to(pending_pos.dtype)
    return out.to(q.dtype)


def _grouped_commit(ssm_state, slots, valid, all_valid, pk32, pu, pg, q32, k32, q_len) -> torch.Tensor:
    """Verify steps 1 + 2 on float32 copies of groups of states (any pool dtype): commit, store rounded,
    continue from the stored value; returns ``S [k | q]`` ``[N, Hv, Dv, 2Q]``."""
    num_seqs, num_v_heads, dv = slots.shape[0], ssm_state.shape[1], ssm_state.shape[2]
    sx = torch.empty(num_seqs, num_v_heads, dv, 2 * q_len, dtype=torch.float32, device=q32.device)
    for lo, hi in _groups(num_seqs, ssm_state.shape):
        rows = slice(lo, hi)
        keep = None if all_valid else valid[rows].nonzero().squeeze(1)
        state = _gather_states(ssm_state, slots[rows], valid[rows], all_valid)
        # 1. commit, store (rounded to the pool dtype), continue from the stored value.
        _decay_update(state, pk32[rows], pu[rows], pg[rows])
        _store_states(ssm_state, slots[rows], state, keep)
        if ssm_state.dtype != torch.float32:
            state = state.to(ssm_state.dtype).float()
        # 2. the committed state's products with the new tokens' k and q: all the verify reads of it.
        sx[rows] = _state_products(state, q32[rows], k32[rows])
    return sx


def _token_coefs(q32: torch.Tensor, k32: torch.Tensor, cum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(e^{cum_j} [N, Q, Hv], A, B [N, Hv, Q(j), Q(l)])`` of :mod:`.cpu_native`: ``A_{jl} = e^{cum_j - cum_l}
    (k_l . k_j)``, ``B_{jl} = e^{cum_j - cum_l} (k_l . q_j)`` (q32 / k32 ``[N, Q, Hk, Dk]`` per key head,
    ``cum [N, Q, Hv]``), the same products and exponentials as :func:`_apply_tokens`."""
    group = cum.shape[2] // k32.shape[2]
    kh, qh = k32.transpose(1, 2), q32.transpose(1, 2)  # [N, Hk, Q, Dk]
    kk = torch.matmul(kh, kh.transpose(-1, -2))  # [N, Hk, Q(l), Q(j)]
    kq = torch.matmul(kh, qh.transpose(-1, -2))
    if group > 1:
        kk, kq = kk.repeat_interleave(group, dim=1), kq.repeat_interleave(group, dim=1)
    ct = cum.transpose(1, 2)  # [N, Hv, Q]
    w = (ct[..., :, None] - ct[..., None, :]).exp()  # [N, Hv, Q(j), Q(l)]: e^{cum_j - cum_l}
    return cum.exp(), w * kk.transpose(-1, -2), w * kq.transpose(-1, -2)


def _verify_native(
    q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm, A_log, dt_bias,
    pending_pos,
) -> torch.Tensor:  # fmt: skip
    """:func:`gated_delta_rule_verify` on a float32 pool through :func:`.cpu_native.gdn_pass`: commit, the
    new tokens' outputs and ``u`` in one pass over each slot's state, then the stash."""
    num_seqs, q_len, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[2], v.shape[3]
    r = pending.shape[1]
    kd, vd = num_k_heads * dk, num_v_heads * dv
    slots = state_indices.long()
    valid = slots >= 0
    safe = slots.clamp(min=0)
    n_commit = num_commit.long() * valid
    # The pending tokens' k (normalised) and g; only the first n_commit of a row are read, and their u
    # straight from the pending pool.
    pk = pending[safe, :, :kd].view(num_seqs, r, num_k_heads, dk)
    _, pk32 = _prepare_qk(pk, pk, num_k_heads, 1.0, use_qk_l2norm)
    take = torch.arange(r, device=q.device)[None, :] < n_commit[:, None]  # [N, R]
    pg = torch.where(take[..., None], pending[safe, :, kd + vd :], 0.0)  # [N, R, Hv]
    pcum = pg.cumsum(1)
    commit = (n_commit, pcum[:, -1].exp(), (pcum[:, -1:] - pcum).exp(), pk32, pending)
    q32, k32, v32, g32, b32 = _float_tokens(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias, False)
    cum = g32.cumsum(1)
    coefs = _token_coefs(q32, k32, cum)
    # the stash (this step's tokens for the next step's commit): u written by the pass itself
    out = cpu_native.gdn_pass(ssm_state, slots, q32, k32, v32, b32, *coefs, commit=commit, stash=pending)
    real = slice(None) if bool(valid.all()) else valid.nonzero().squeeze(1)
    rows = slots[real]
    pending[rows, :q_len, :kd] = k[real].flatten(2).float()
    pending[rows, :q_len, kd + vd :] = g32[real]
    if pending_pos is not None:
        pending_pos[rows, 0] += num_commit[real].to(pending_pos.dtype)
    return out.to(q.dtype)
