"""Paged attention for CPUs: the reference's contract and float32 softmax, sequences batched.

Sequences with at most :data:`.cpu_native.MAX_Q` new queries (decode, MTP verify) go through one C pass
(:mod:`.cpu_native`: per sequence and KV head, each cached key and value row read once in place, online
softmax in float32) where a C compiler builds it; that pass also checks the indices and zeroes the padding
rows. The rest (longer prompt chunks, or every sequence where there is no C build or q is float16) takes
the torch path below.

The reference attends one sequence at a time (a dozen small ops per sequence, so a decode batch of
hundreds of sequences, or a step with dozens of short prompts, is mostly per-op overhead). The torch path
takes the sequences with at most :data:`BATCHED_MAX_Q` new queries in groups: each group's keys and values
are gathered once into ``[n, S, Hkv, D]`` (S = the group's longest sequence), its queries padded to
``[n, Qmax, Hkv, group, D]``, and one masked softmax covers the group (a key is seen by a query iff its position is <= the query's; padded keys and
queries are masked out). A group holds about :data:`KV_BLOCK_BYTES` of float32 keys, values and scores,
so its temporaries stay cache-sized. Longer prompt chunks take the reference's per-sequence path.
"""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import FP8_DTYPES
from atom_kernels.ops._fp8_math import scale_tensor
from atom_kernels.ops.paged_attention import cpu_native
from atom_kernels.ops.paged_attention.checks import check_paged_attention, check_paged_attention_values
from atom_kernels.ops.paged_attention.reference import _load

BATCHED_MAX_Q = 256
"""Sequences with at most this many new queries (decode, verify, short prompt chunks) take the batched
path; longer prompt chunks attend one sequence at a time."""

KV_BLOCK_BYTES = 4 << 20
"""float32 key + value + score bytes of one group of sequences (at least one sequence per group)."""


def _attend_one(out, q, key_cache, value_cache, block_tables, n, qs, qe, seq_len, scale, ks, vs) -> None:
    """The reference's per-sequence attention of sequence ``n`` (rows ``qs:qe``)."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    q_len = qe - qs
    pos = torch.arange(seq_len, device=q.device)
    blocks = block_tables[n, pos // block_size].long()
    keys = _load(key_cache[blocks, pos % block_size], ks)
    values = _load(value_cache[blocks, pos % block_size], vs)
    if group > 1:
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("lhd,shd->hls", q[qs:qe].float(), keys) * scale
    q_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
    scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out[qs:qe] = torch.einsum("hls,shd->lhd", probs, values).to(q.dtype)


def _gather_tokens(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``cache[blocks[m], offsets[m]]`` as ``[M, Hkv * D]`` rows, by ``index_select`` over a row table.

    vLLM's caches are often views with a per-block stride of their own (hybrid pages padded to the
    GDN state's page): never reshaped (that would copy the whole cache). Where each block's tokens are
    contiguous rows and the block stride is a whole number of rows, the memory is seen as one table of
    rows (a view, padding rows included) and token ``(b, o)`` is row ``b * rows_per_block + o``; otherwise
    the cache is indexed by (block, offset)."""
    num_blocks, block_size, heads, dim = cache.shape
    width = heads * dim
    s0, s1, s2, s3 = cache.stride()
    if num_blocks and s3 == 1 and s2 == dim and s1 == width and s0 % width == 0:
        per_block = s0 // width
        table = cache.as_strided(((num_blocks - 1) * per_block + block_size, width), (width, 1))
        return table.index_select(0, blocks * per_block + offsets)
    return cache[blocks, offsets].reshape(-1, width)


def _shared_rows(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int] | None:
    """``(row, value_offset)`` where each token's keys and values lie in one row of ``row`` elements of one
    memory (vLLM's ``[block, token, head, K | V]`` page: the values ``value_offset`` elements after the
    keys), so one row gather serves both; otherwise ``None``."""
    if key_cache.dtype != value_cache.dtype or key_cache.stride() != value_cache.stride():
        return None
    if key_cache.untyped_storage().data_ptr() != value_cache.untyped_storage().data_ptr():
        return None
    num_blocks, _, heads, dim = key_cache.shape
    s0, s1, s2, s3 = key_cache.stride()
    offset = value_cache.storage_offset() - key_cache.storage_offset()
    row = offset + (heads - 1) * s2 + dim  # from a token's first key element to its last value element
    if num_blocks == 0 or s3 != 1 or offset < dim or row > s1 or s0 % s1 or s2 < dim:
        return None
    return row, offset


def _gather_kv(key_cache, value_cache, blocks, offsets, ks, vs) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(keys, values)`` of the tokens ``(blocks[m], offsets[m])``, each ``[M, Hkv, D]``: where
    keys and values share rows (:func:`_shared_rows`), strided views of one gathered, converted buffer."""
    shared = _shared_rows(key_cache, value_cache)
    heads, dim = key_cache.shape[2], key_cache.shape[3]
    if shared is None or key_cache.dtype in FP8_DTYPES:
        keys = _load(_gather_tokens(key_cache, blocks, offsets), ks).view(-1, heads, dim)
        return keys, _load(_gather_tokens(value_cache, blocks, offsets), vs).view(-1, heads, dim)
    row, value_offset = shared
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    s0, s1, s2, _ = key_cache.stride()
    per_block = s0 // s1
    table = key_cache.as_strided(((num_blocks - 1) * per_block + block_size, row), (s1, 1))
    rows = table.index_select(0, blocks * per_block + offsets).float()  # [M, row] contiguous
    size, stride = (rows.shape[0], heads, dim), (row, s2, 1)
    return rows.as_strided(size, stride, 0), rows.as_strided(size, stride, value_offset)


def _attend_group(out, q, key_cache, value_cache, block_tables, seqs, starts, q_lens, lens, scale, ks, vs):
    """Sequences ``seqs`` (each with 1 <= q_len <= BATCHED_MAX_Q new queries) in one masked softmax."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    device = q.device
    n = len(seqs)
    max_len = max(lens[i] for i in seqs)
    max_q = max(q_lens[i] for i in seqs)
    idx = torch.tensor(seqs, dtype=torch.long, device=device)
    start = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device)
    q_len = torch.tensor([q_lens[i] for i in seqs], dtype=torch.long, device=device)
    seq_len = torch.tensor([lens[i] for i in seqs], dtype=torch.long, device=device)
    # Key positions 0 .. max_len - 1 of each sequence; a shorter sequence re-reads its last token there
    # (real data, so no garbage reaches the products; those scores are masked).
    k_pos = torch.arange(max_len, device=device)
    pos = torch.minimum(k_pos[None, :], seq_len[:, None] - 1)  # [n, S]
    blocks = block_tables[idx].long().gather(1, pos // block_size).reshape(-1)  # [n * S]
    offsets = (pos % block_size).reshape(-1)
    keys, values = _gather_kv(key_cache, value_cache, blocks, offsets, ks, vs)  # [n * S, Hkv, D] float32
    keys, values = (
        keys.view(n, max_len, num_kv_heads, head_dim),
        values.view(n, max_len, num_kv_heads, head_dim),
    )
    i = torch.arange(max_q, device=device)
    real = i[None, :] < q_len[:, None]  # [n, Qmax]
    rows = torch.where(real, start[:, None] + i[None, :], 0)
    qf = q[rows].float()  # [n, Qmax, Hq, D]
    q_pos = seq_len[:, None] - q_len[:, None] + i[None, :]  # [n, Qmax]
    hidden = k_pos[None, None, :] > q_pos[:, :, None]  # [n, Qmax, S] (also every position >= seq_len)
    o = torch.empty(n, max_q, num_q_heads, head_dim, dtype=torch.float32, device=device)
    for h in range(num_kv_heads):  # strided [n, S, D] views of this KV head: no copy for the matmuls
        k_h, v_h = keys[:, :, h], values[:, :, h]
        q_h = qf[:, :, h * group : (h + 1) * group].reshape(n, max_q * group, head_dim)  # rows (query, g)
        scores = torch.bmm(q_h, k_h.transpose(1, 2)).view(n, max_q, group, max_len) * scale
        probs = torch.softmax(scores.masked_fill_(hidden[:, :, None], float("-inf")), dim=-1)
        o[:, :, h * group : (h + 1) * group] = torch.bmm(probs.view(n, max_q * group, max_len), v_h).view(
            n, max_q, group, head_dim
        )
    out[rows[real]] = o[real].to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`atom_kernels.ops.paged_attention.reference.paged_attention` (same contract)."""
    check_paged_attention(
        q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, out
    )
    ks, vs = scale_tensor(k_scale, q.device), scale_tensor(v_scale, q.device)
    args = (q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, ks, vs)
    if cpu_native.usable(q, key_cache, value_cache):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        if cpu_native.attend(*args, out) == 0:  # the C pass wrote every row
            return out
        _attend_torch(out, *args, skip_q=cpu_native.MAX_Q)
        return out
    block_size = key_cache.shape[1]
    check_paged_attention_values(block_tables, seq_lens, query_start_loc, block_size, q.shape[0])
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device) if out is None else out.zero_()
    _attend_torch(out, *args, skip_q=0)
    return out


def _attend_torch(
    out, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, ks, vs, skip_q
) -> None:
    """The torch path into ``out`` for the sequences with more than ``skip_q`` queries: grouped up to
    :data:`BATCHED_MAX_Q` queries, one at a time beyond."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    q_lens = [starts[n + 1] - starts[n] for n in range(len(lens))]
    kv_bytes_per_token = 2 * num_kv_heads * head_dim * 4
    score_bytes = q.shape[1] * 4  # per (query, key) pair: one float32 score per query head
    batch: list[int] = []
    batch_tokens = 0
    batch_q = 0
    for n, seq_len in enumerate(lens):
        if q_lens[n] <= skip_q:
            continue
        if q_lens[n] > BATCHED_MAX_Q:
            _attend_one(
                out,
                q,
                key_cache,
                value_cache,
                block_tables,
                n,
                starts[n],
                starts[n + 1],
                seq_len,
                scale,
                ks,
                vs,
            )
            continue
        longest = max(batch_tokens, seq_len)
        most_q = max(batch_q, q_lens[n])
        per_seq = longest * (kv_bytes_per_token + most_q * score_bytes)
        if batch and per_seq * (len(batch) + 1) > KV_BLOCK_BYTES:
            _attend_group(
                out, q, key_cache, value_cache, block_tables, batch, starts, q_lens, lens, scale, ks, vs
            )
            batch, longest, most_q = [], seq_len, q_lens[n]
        batch.append(n)
        batch_tokens, batch_q = longest, most_q
    if batch:
        _attend_group(
            out, q, key_cache, value_cache, block_tables, batch, starts, q_lens, lens, scale, ks, vs
        )
