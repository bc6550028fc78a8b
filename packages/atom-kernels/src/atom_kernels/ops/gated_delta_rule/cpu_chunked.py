"""Chunked gated delta rule (prefill) for CPUs: the reference's chunked form without triangular solves.

Same WY/UT transform as :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_chunked`
(sequences padded to whole chunks of ``chunk_size`` tokens, vectorised over sequences, heads and
chunks; only the chunk-to-chunk state recurrence is a loop). The reference solves
``(I + A) [u | w] = [beta V | beta K e^cum]`` with ``torch.linalg.solve_triangular`` per chunk and head,
which a CPU runs as one small LAPACK call per matrix. Here the unit lower-triangular ``(I + A)`` of every
(sequence, head, chunk) is inverted at once by block doubling::

    inv([[P, 0], [C, R]]) = [[P^-1, 0], [-R^-1 C P^-1, R^-1]]

from 1 x 1 diagonal blocks (all ones) up to ``chunk_size`` (log2(chunk_size) levels of two batched
matmuls each, written in place into one buffer), then ``u`` and ``w`` are one batched matmul each.
The tokens are laid out chunk-major once (``[chunks, N, H, C, D]`` contiguous; q and k per key head,
since ``q k^T`` and ``k k^T`` are the same for the value heads of a group), so each chunk's operands of
the recurrence are one contiguous ``[N * Hv, C, D]`` block. A chunk that starts from no state (a fresh
prompt) skips the products with it, and a group of one-chunk fresh prompts computes neither ``w`` nor the
decayed queries. The state is kept in the pool's ``[Dv, Dk]`` layout: in place in a float32 pool whose
slots for the group are consecutive, otherwise gathered once and stored with one indexed copy. The batch
goes through in groups of consecutive sequences of about :data:`~atom_kernels.ops._groups.GROUP_TOKENS`
tokens, whose temporaries stay in cache. Same float32 math as the reference up to the order of the sums
(tolerances in the conformance tests); the final state is rounded to the pool dtype when stored.

Tokens on a float32 pool that :func:`~atom_kernels.ops.gated_delta_rule.cpu_native_prefill.usable` takes
go to that module's C pass instead (each state row carried through its sequence's tokens; float32 and bf16
q/k/v read in place), which measured faster than this form on every prompt shape tried
(``benchmarks/cpu_gdn_prefill.py``). On bf16 tokens its outputs are as close to the float64 rule as this
form's (docs/performance.md); the two differ in where a float32 sum lands next to a bf16 rounding boundary.
"""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import check_cu_seqlens_values, check_slot_values
from atom_kernels.ops._groups import sequence_groups
from atom_kernels.ops.gated_delta_rule import cpu_native_prefill
from atom_kernels.ops.gated_delta_rule.checks import check_gated_delta_rule_chunked
from atom_kernels.ops.gated_delta_rule.reference import _read_states
from atom_kernels.ops.l2norm.reference import l2norm_f32


def _block(x: torch.Tensor, m: int, row: int, col: int) -> torch.Tensor:
    """Block ``(row, col)`` (each 0 or 1) of every ``2m x 2m`` diagonal block of ``x [B, C, C]``: a
    ``[B, C / 2m, m, m]`` view."""
    batch, size, _ = x.shape
    pairs = size // (2 * m)
    view = x.view(batch, pairs, 2, m, pairs, 2, m).diagonal(dim1=1, dim2=4)  # [B, 2, m, 2, m, P]
    return view[:, row, :, col].permute(0, 3, 1, 2)


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I + strictly_lower(a))^-1`` for a batch ``a [B, C, C]`` float32.

    Only the strictly lower triangle of ``a`` is read. Returns ``[B, C, C]`` (unit lower triangular),
    built by block doubling: the inverses of the ``m x m`` diagonal blocks give those of the ``2m x 2m``
    blocks, ``log2(C)`` levels of two batched matmuls each (``C`` a power of two; any other ``C``: one
    triangular solve against the identity)."""
    batch, size, _ = a.shape
    if size & (size - 1):  # not a power of two: one triangular solve against the identity
        eye = torch.eye(size, dtype=a.dtype, device=a.device).expand(batch, size, size)
        return torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
    inv = torch.zeros_like(a)
    inv.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    m = 1
    while m < size:
        corner = -torch.matmul(_block(inv, m, 1, 1), torch.matmul(_block(a, m, 1, 0), _block(inv, m, 0, 0)))
        _block(inv, m, 1, 0).copy_(corner)
        m *= 2
    return inv


def _consecutive_rows(ssm_state: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor | None:
    """``ssm_state[lo : lo + N]`` where the ``N`` slots are ``lo, lo + 1, ...`` and the pool is float32 and
    contiguous (the state can be updated in place there); otherwise None. One host read of the slots."""
    if ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous() or state_indices.shape[0] == 0:
        return None
    rows = state_indices.tolist()
    lo = rows[0]
    if lo < 0 or rows != list(range(lo, lo + len(rows))):
        return None
    return ssm_state[lo : lo + len(rows)]


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
    """:func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_chunked` (same contract).

    Args:
        q, k: ``[T, Hk, Dk]``; v: ``[T, Hv, Dv]``; g (log decay, <= 0), beta: ``[T, Hv]``.
        cu_seqlens: ``[N+1]`` int32 offsets.
        ssm_state: ``[S, Hv, Dv, Dk]`` float32/bf16, updated in place.
        state_indices: ``[N]`` int32 slots (< 0: padding; zero initial state, nothing written).
        has_initial_state: ``[N]`` bool; where False the initial state is zero.
        scale: query scale; use_qk_l2norm: L2-normalise q and k (eps 1e-6) first.
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
    check_cu_seqlens_values(op, cu_seqlens, v.shape[0])
    if cpu_native_prefill.usable(ssm_state):  # the C pass over each row
        args = (cu_seqlens, ssm_state, state_indices, has_initial_state, scale, use_qk_l2norm)
        return cpu_native_prefill.gdn_prefill(q, k, v, g, beta, *args)
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    offsets = cu_seqlens.tolist()
    for lo, hi in sequence_groups(offsets):
        t0, t1 = offsets[lo], offsets[hi]
        out[t0:t1] = _chunked(
            q[t0:t1],
            k[t0:t1],
            v[t0:t1],
            g[t0:t1],
            beta[t0:t1],
            cu_seqlens[lo : hi + 1] - cu_seqlens[lo],
            ssm_state,
            state_indices[lo:hi],
            has_initial_state[lo:hi],
            scale,
            use_qk_l2norm,
            chunk_size,
        )
    return out


def _chunked(
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
):
    """The rule for one group of sequences (checked arguments, ``cu_seqlens`` from 0); returns ``o``."""
    total, num_v_heads, dv = v.shape
    dk = q.shape[-1]
    num_seqs = state_indices.shape[0]
    device = q.device
    offsets = cu_seqlens.long()
    lens = offsets[1:] - offsets[:-1]
    lens_host = lens.tolist()
    max_len = max(lens_host) if num_seqs > 0 else 0
    chunk = chunk_size
    padded = max(chunk, -(-max_len // chunk) * chunk)
    num_chunks = padded // chunk
    dense = num_seqs > 0 and all(n == padded for n in lens_host)  # no padding: views, no scatter

    num_k_heads = q.shape[1]
    group = num_v_heads // num_k_heads
    # q, k stay per key head: the products of q and k with k are the same for the value heads of a group.
    q32, k32 = q.float().contiguous(), k.float().contiguous()
    if use_qk_l2norm:
        q32, k32 = l2norm_f32(q32), l2norm_f32(k32)
    if dense:
        seq_id = pos = None
    else:
        seq_id = torch.repeat_interleave(torch.arange(num_seqs, device=device), lens)
        pos = torch.arange(total, device=device) - offsets[seq_id]

    def chunk_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T, H, ...] -> [nC, N, H, C, ...]
        if dense:
            out = x.reshape(num_seqs, padded, *x.shape[1:])
        else:
            out = x.new_zeros((num_seqs, padded, *x.shape[1:]))
            out[seq_id, pos] = x
        out = out.view(num_seqs, num_chunks, chunk, *x.shape[1:]).transpose(0, 1).transpose(2, 3)
        return torch.empty(out.shape, dtype=dtype, device=device).copy_(out)  # contiguous, in dtype: one pass

    def by_group(x: torch.Tensor) -> torch.Tensor:  # [nC, N, Hv, ...] -> [nC, N, Hk, G, ...] (a view)
        return x.view(num_chunks, num_seqs, num_k_heads, group, *x.shape[3:])

    qc, kc = chunk_major(q32, torch.float32), chunk_major(k32, torch.float32)  # [nC, N, Hk, C, Dk]
    vc = by_group(chunk_major(v, torch.float32))  # [nC, N, Hk, G, C, Dv]
    gc = by_group(chunk_major(g, torch.float32))  # [nC, N, Hk, G, C]
    bc = by_group(chunk_major(beta, torch.float32))

    cum = gc.cumsum(dim=-1)
    ecum = cum.exp()
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()  # [.., C, C]
    kt = kc.transpose(-1, -2)
    kk = torch.matmul(kc, kt)[:, :, :, None]  # [nC, N, Hk, 1, C, C]: k_i . k_j
    qk = torch.matmul(qc, kt)[:, :, :, None]  # q_i . k_j (q unscaled)

    # The state in the pool's layout [N * Hv, Dv, Dk] (S^T of the "kv" form the equations use).
    # No initial state anywhere (a fresh prompt): the first chunk's products with it are zeros and skipped,
    # and a batch of such one-chunk sequences needs neither w nor the decayed queries.
    slots = state_indices.long()
    valid = slots >= 0
    use_init = has_initial_state & valid
    batch = num_seqs * num_v_heads
    # A float32 pool whose slots for the group are consecutive holds the state in place (not gathered,
    # not stored): its rows are updated chunk by chunk, those without an initial state zeroed first.
    in_pool = _consecutive_rows(ssm_state, state_indices)
    state = None
    if bool(use_init.any()):
        if in_pool is None:
            state = _read_states(ssm_state, state_indices, use_init).view(batch, dv, dk)
        else:
            if not bool(use_init.all()):
                in_pool.index_fill_(0, (~use_init).nonzero().squeeze(1), 0.0)
            state = in_pool.view(batch, dv, dk)
    with_state = state is not None or num_chunks > 1

    # UT transform: (I + strictly_lower(beta_i (k_i . k_j) decay_ij)) [u | w] = [beta V | beta K e^cum].
    rows = num_chunks * batch
    system = (bc[..., :, None] * decay).mul_(kk)
    inverse = unit_lower_inverse(system.view(rows, chunk, chunk))
    beta_v = torch.mul(vc, bc[..., None])
    u = torch.bmm(inverse, beta_v.view(rows, chunk, dv)).view(num_chunks, batch, chunk, dv)
    attn = (decay * scale).mul_(qk).view(num_chunks, batch, chunk, chunk)  # causal, diagonal in
    k_to_end = torch.mul(kc[:, :, :, None], (cum[..., -1:] - cum).exp_()[..., None])
    k_to_end = k_to_end.view(num_chunks, batch, chunk, dk)
    if with_state:
        beta_k = torch.mul(kc[:, :, :, None], (bc * ecum)[..., None])
        w = torch.bmm(inverse, beta_k.view(rows, chunk, dk)).view(num_chunks, batch, chunk, dk)
        q_decayed = torch.mul(qc[:, :, :, None], (ecum * scale)[..., None])
        q_decayed = q_decayed.view(num_chunks, batch, chunk, dk)
    chunk_decay = ecum[..., -1].reshape(num_chunks, batch, 1, 1)

    out = torch.empty(num_chunks, batch, chunk, dv, dtype=torch.float32, device=device)
    for i in range(num_chunks):
        if state is None:
            torch.bmm(attn[i], u[i], out=out[i])
            # a transposed first operand makes the batched matmul several times slower: copy it first
            ut = u[i].transpose(1, 2).contiguous()
            if in_pool is None:
                state = torch.bmm(ut, k_to_end[i])
            else:
                state = torch.bmm(ut, k_to_end[i], out=in_pool.view(batch, dv, dk))
            continue
        st = state.transpose(1, 2)  # [B, Dk, Dv]
        v_new = u[i] - torch.bmm(w[i], st)
        torch.bmm(q_decayed[i], st, out=out[i])
        out[i] += torch.bmm(attn[i], v_new)
        state.mul_(chunk_decay[i])
        state += torch.bmm(v_new.transpose(1, 2).contiguous(), k_to_end[i])

    if in_pool is None:
        state = state.view(num_seqs, num_v_heads, dv, dk).to(ssm_state.dtype)
        if bool(valid.all()):
            ssm_state.index_copy_(0, slots, state)
        else:
            keep = valid.nonzero().squeeze(1)
            ssm_state.index_copy_(0, slots[keep], state[keep])
    out = out.view(num_chunks, num_seqs, num_v_heads, chunk, dv).permute(1, 0, 3, 2, 4)  # [N, nC, C, Hv, Dv]
    if dense:  # one pass: transpose and round
        result = torch.empty(num_seqs, num_chunks, chunk, num_v_heads, dv, dtype=q.dtype, device=device)
        return result.copy_(out).view(total, num_v_heads, dv)
    return out.reshape(num_seqs, padded, num_v_heads, dv)[seq_id, pos].to(q.dtype)
