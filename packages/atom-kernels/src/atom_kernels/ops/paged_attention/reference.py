"""Reference paged KV cache write and paged attention (float32 softmax, one sequence at a time).

Cache layout ``[B, block_size, Hkv, D]``; token position p of sequence n lives in block
``block_tables[n, p // block_size]`` at offset ``p % block_size``; a slot is
``block * block_size + offset``. fp8 (e4m3) caches hold ``x / scale`` (per-tensor float32 scale).
"""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import FP8_DTYPES
from atom_kernels.ops._fp8_math import FP8_MAX, scale_tensor
from atom_kernels.ops.paged_attention.checks import (
    check_kv_cache_write,
    check_paged_attention,
    check_paged_attention_values,
    check_slot_mapping_values,
)


def _store(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    if cache_dtype in FP8_DTYPES:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def _load(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if x.dtype in FP8_DTYPES:
        return x.float() * scale
    return x.float()


def kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Scatter the new tokens' K/V into the paged caches (in place).

    Args:
        k, v: ``[T, Hkv, D]``.
        key_cache, value_cache: ``[B, block_size, Hkv, D]`` in k.dtype or float8_e4m3fn (any strides).
        slot_mapping: ``[T]`` int64 slots (< 0: skipped, e.g. padding).
        k_scale, v_scale: per-tensor float32 scales for fp8 caches (None: 1.0); ignored otherwise.
    """
    check_kv_cache_write(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    num_blocks, block_size = key_cache.shape[:2]
    check_slot_mapping_values(slot_mapping, num_blocks, block_size)
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[keep]
    block, offset = slots // block_size, slots % block_size
    key_cache[block, offset] = _store(k[keep], key_cache.dtype, scale_tensor(k_scale, k.device))
    value_cache[block, offset] = _store(v[keep], value_cache.dtype, scale_tensor(v_scale, v.device))


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
    """Causal attention of each sequence's new queries over its whole cached sequence.

    Args:
        q: ``[T, Hq, D]``; sequence n owns rows ``query_start_loc[n] : query_start_loc[n + 1]``
            (q_len_n of them, 0 allowed), its last q_len_n tokens.
        key_cache, value_cache: ``[B, block_size, Hkv, D]`` (q.dtype or float8_e4m3fn), already holding
            every token of each sequence, the new ones included.
        block_tables: ``[N, max_blocks]`` int32.
        seq_lens: ``[N]`` int32 total tokens of each sequence (cached prefix + new).
        query_start_loc: ``[N+1]`` int32 offsets into T.
        scale: softmax scale (usually ``D ** -0.5``).
        k_scale, v_scale: per-tensor scales of fp8 caches (None: 1.0).
        out: ``[T, Hq, D]`` in q.dtype, unit last-dim stride: written in place and returned (None: a new
            tensor).

    Returns:
        ``o [T, Hq, D]`` in q.dtype; query i of sequence n sits at position ``seq_lens[n] - q_len_n + i``
        and attends to key positions ``[0, position]`` (query head h uses KV head ``h // (Hq // Hkv)``).
        Rows past ``query_start_loc[N]`` are zero.
    """
    check_paged_attention(
        q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, out
    )
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    check_paged_attention_values(block_tables, seq_lens, query_start_loc, block_size, q.shape[0])
    group = q.shape[1] // num_kv_heads
    ks, vs = scale_tensor(k_scale, q.device), scale_tensor(v_scale, q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device) if out is None else out.zero_()
    for n, seq_len in enumerate(lens):
        qs, qe = starts[n], starts[n + 1]
        q_len = qe - qs
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[n, pos // block_size].long()
        keys = _load(key_cache[blocks, pos % block_size], ks)  # [S, Hkv, D]
        values = _load(value_cache[blocks, pos % block_size], vs)
        if group > 1:
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("lhd,shd->hls", q[qs:qe].float(), keys) * scale
        q_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qs:qe] = torch.einsum("hls,shd->lhd", probs, values).to(q.dtype)
    return out
