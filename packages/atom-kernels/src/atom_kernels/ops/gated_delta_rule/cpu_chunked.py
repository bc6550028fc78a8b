"""Chunked gated delta rule (prefill) for CPUs: the reference's chunked form without triangular solves.

Same WY/UT transform as :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_chunked`
(sequences padded to whole chunks of ``chunk_size`` tokens, vectorised over sequences, heads and
chunks; only the chunk-to-chunk state recurrence is a loop). The reference solves
``(I + A) [u | w] = [beta V | beta K e^cum]`` with ``torch.linalg.solve_triangular`` per chunk and head,
which a CPU runs as one small LAPACK call per matrix. Here the unit lower-triangular ``(I + A)`` of every
(sequence, head, chunk) is inverted at once by block doubling::

    inv([[P, 0], [C, R]]) = [[P^-1, 0], [-R^-1 C P^-1, R^-1]]

from 1 x 1 diagonal blocks (all ones) up to ``chunk_size`` (log2(chunk_size) levels of two batched
matmuls each), then ``[u | w] = (I + A)^-1 [beta V | beta K e^cum]`` is one batched matmul. The tokens are
laid out head-major once (``[N, H, chunks, C, D]`` contiguous; q and k per key head, since ``q k^T`` and
``k k^T`` are the same for the value heads of a group), so the batched matmuls read contiguous operands,
a chunk that starts from no state (a fresh prompt) skips the products with it, the state is kept in the
pool's ``[Dv, Dk]`` layout and stored with one indexed copy, and the batch goes through in groups of
consecutive sequences of about :data:`~atom_kernels.ops._groups.GROUP_TOKENS` tokens, whose temporaries
stay in cache. Same float32 math as the reference up to the order of the sums (tolerances in the
conformance tests); the final state is rounded to the pool dtype when stored.
"""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import check_cu_seqlens_values, check_slot_values
from atom_kernels.ops._groups import sequence_groups
from atom_kernels.ops.gated_delta_rule.checks import check_gated_delta_rule_chunked
from atom_kernels.ops.gated_delta_rule.reference import _read_states
from atom_kernels.ops.l2norm.reference import l2norm_f32


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
    inv = torch.ones(batch, size, 1, 1, dtype=a.dtype, device=a.device)  # [B, nb, m, m] diagonal blocks
    m = 1
    while m < size:
        pairs = size // (2 * m)
        # lower-left m x m block of each 2m x 2m diagonal block: rows (2p+1)m.., cols 2pm..
        blocks = a.view(batch, pairs, 2, m, pairs, 2, m).diagonal(dim1=1, dim2=4)  # [B, 2, m, 2, m, P]
        lower = blocks[:, 1, :, 0].permute(0, 3, 1, 2)  # [B, P, m, m]
        top = inv[:, 0::2]  # [B, P, m, m]
        bottom = inv[:, 1::2]
        corner = -torch.matmul(bottom, torch.matmul(lower, top))
        new = inv.new_zeros(batch, pairs, 2 * m, 2 * m)
        new[:, :, :m, :m] = top
        new[:, :, m:, m:] = bottom
        new[:, :, m:, :m] = corner
        inv = new
        m *= 2
    return inv.view(batch, size, size)


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

    def head_major(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [N, H, nC, C, ...] contiguous
        if dense:
            out = x.reshape(num_seqs, padded, *x.shape[1:])
        else:
            out = x.new_zeros((num_seqs, padded, *x.shape[1:]))
            out[seq_id, pos] = x
        out = out.movedim(1, 2).contiguous()
        return out.view(num_seqs, x.shape[1], num_chunks, chunk, *x.shape[2:])

    def by_group(x: torch.Tensor) -> torch.Tensor:  # [N, Hv, ...] -> [N, Hk, G, ...] (a view)
        return x.view(num_seqs, num_k_heads, group, *x.shape[2:])

    qc, kc = head_major(q32), head_major(k32)  # [N, Hk, nC, C, Dk]
    vc = by_group(head_major(v.float()))  # [N, Hk, G, nC, C, Dv]
    gc, bc = by_group(head_major(g.float())), by_group(head_major(beta.float()))  # [N, Hk, G, nC, C]

    cum = gc.cumsum(dim=-1)
    ecum = cum.exp()
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()  # [.., C, C]
    kt = kc.transpose(-1, -2)
    kk = torch.matmul(kc, kt)[:, :, None]  # [N, Hk, 1, nC, C, C]: k_i . k_j
    qk = torch.matmul(qc, kt)[:, :, None]  # q_i . k_j (q unscaled)
    # UT transform: (I + strictly_lower(beta_i (k_i . k_j) decay_ij)) [u | w] = [beta V | beta K e^cum].
    rows = num_seqs * num_v_heads * num_chunks
    system = (bc[..., :, None] * decay).mul_(kk)
    inverse = unit_lower_inverse(system.view(rows, chunk, chunk))
    rhs = torch.empty(*vc.shape[:-1], dv + dk, dtype=torch.float32, device=device)
    torch.mul(vc, bc[..., None], out=rhs[..., :dv])
    torch.mul(kc[:, :, None], (bc * ecum)[..., None], out=rhs[..., dv:])
    uw = torch.bmm(inverse, rhs.view(rows, chunk, dv + dk)).view(rhs.shape)
    u, w = uw[..., :dv], uw[..., dv:]
    attn = (decay * scale).mul_(qk)  # intra-chunk causal scores, diagonal included (q scaled)
    q_decayed = qc[:, :, None] * (ecum * scale)[..., None]  # [N, Hk, G, nC, C, Dk]
    k_to_end = kc[:, :, None] * (cum[..., -1:] - cum).exp_()[..., None]  # [N, Hk, G, nC, C, Dk]
    chunk_decay = ecum[..., -1, None, None]  # [N, Hk, G, nC, 1, 1]

    # The state in the pool's layout [N, Hk, G, Dv, Dk] (S^T of the "kv" form the equations use).
    # No initial state anywhere (a fresh prompt): the first chunk's products with it are zeros and skipped.
    slots = state_indices.long()
    valid = slots >= 0
    use_init = has_initial_state & valid
    state = None
    if bool(use_init.any()):
        state = by_group(_read_states(ssm_state, state_indices, use_init))
    out = torch.empty(num_seqs, num_k_heads, group, num_chunks, chunk, dv, dtype=torch.float32, device=device)
    for i in range(num_chunks):
        o_i = out[..., i, :, :]
        if state is None:
            v_new = u[..., i, :, :]
            torch.matmul(attn[..., i, :, :], v_new, out=o_i)
            # a transposed first operand makes the batched matmul several times slower: copy it first
            state = torch.matmul(v_new.transpose(-1, -2).contiguous(), k_to_end[..., i, :, :])
            continue
        st = state.transpose(-1, -2)  # [.., Dk, Dv]
        v_new = u[..., i, :, :] - torch.matmul(w[..., i, :, :], st)
        torch.matmul(q_decayed[..., i, :, :], st, out=o_i)
        o_i += torch.matmul(attn[..., i, :, :], v_new)
        state.mul_(chunk_decay[..., i, :, :])
        state += torch.matmul(v_new.transpose(-1, -2).contiguous(), k_to_end[..., i, :, :])

    state = state.view(num_seqs, num_v_heads, dv, dk).to(ssm_state.dtype)
    if bool(valid.all()):
        ssm_state.index_copy_(0, slots, state)
    else:
        keep = valid.nonzero().squeeze(1)
        ssm_state.index_copy_(0, slots[keep], state[keep])
    out = out.view(num_seqs, num_v_heads, padded, dv).movedim(2, 1)  # [N, padded, Hv, Dv]
    if dense:  # one pass: transpose and round
        result = torch.empty(num_seqs, padded, num_v_heads, dv, dtype=q.dtype, device=device)
        return result.copy_(out).view(total, num_v_heads, dv)
    return out[seq_id, pos].to(q.dtype)
