from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, FP8_DTYPES, Checker, values_checkable

CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def check_scale(c: Checker, name: str, scale: object) -> None:
    """A per-tensor scale: None, a positive Python number, or a one-element float32 tensor."""
    if scale is None:
        return
    if isinstance(scale, torch.Tensor):
        c.require(
            scale.numel() == 1,
            f"{name} must hold one element (per-tensor scale), got shape {tuple(scale.shape)}",
        )
        c.require(scale.dtype == torch.float32, f"{name} must have dtype float32, got {scale.dtype}")
        c.require(scale.device == c.device, f"{name} is on {scale.device}, expected {c.device}")
    else:
        c.positive_float(name, scale)


def _caches(c: Checker, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    c.tensor("key_cache", key_cache, ("B", "block_size", "Hkv", "D"), CACHE_DTYPES)
    c.tensor("value_cache", value_cache, ("B", "block_size", "Hkv", "D"), (key_cache.dtype,))


def check_kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: object,
    v_scale: object,
) -> None:
    c = Checker("kv_cache_write")
    c.tensor("k", k, ("T", "Hkv", "D"), FLOAT_DTYPES)
    c.tensor("v", v, ("T", "Hkv", "D"), (k.dtype,))
    _caches(c, key_cache, value_cache)
    c.tensor("slot_mapping", slot_mapping, ("T",), (torch.int64,))
    check_scale(c, "k_scale", k_scale)
    check_scale(c, "v_scale", v_scale)
    if key_cache.dtype not in FP8_DTYPES:
        c.require(
            key_cache.dtype == k.dtype,
            f"key_cache must have k's dtype {k.dtype} (or fp8), got {key_cache.dtype}",
        )


def check_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: object,
    v_scale: object,
    out: torch.Tensor | None = None,
) -> None:
    c = Checker("paged_attention")
    c.tensor("q", q, ("T", "Hq", "D"), FLOAT_DTYPES)
    _caches(c, key_cache, value_cache)
    c.tensor("block_tables", block_tables, ("N", "max_blocks"), (torch.int32,))
    c.tensor("seq_lens", seq_lens, ("N",), (torch.int32,))
    c.dims["N+1"] = c.dim("N") + 1
    c.tensor("query_start_loc", query_start_loc, ("N+1",), (torch.int32,))
    hq, hkv = c.dim("Hq"), c.dim("Hkv")
    c.require(hq % hkv == 0, f"the query heads Hq={hq} must be a multiple of the KV heads Hkv={hkv}")
    c.positive_float("scale", scale)
    check_scale(c, "k_scale", k_scale)
    check_scale(c, "v_scale", v_scale)
    if key_cache.dtype not in FP8_DTYPES:
        c.require(
            key_cache.dtype == q.dtype,
            f"key_cache must have q's dtype {q.dtype} (or fp8), got {key_cache.dtype}",
        )
    if c.optional("out", out, ("T", "Hq", "D"), (q.dtype,)) is not None:
        c.require(out.stride(-1) == 1, f"out needs a unit last-dim stride, got strides {out.stride()}")


def check_slot_mapping_values(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """``kv_cache_write``: slots must be ``< B * block_size`` (< 0: skipped). Reads values: the backends
    call it only where that costs no device sync (see docs/kernel-api.md)."""
    if values_checkable(slot_mapping) and slot_mapping.numel() > 0:
        hi = int(slot_mapping.max())
        if hi >= num_blocks * block_size:
            raise ValueError(
                f"kv_cache_write: slot_mapping must be < B * block_size = {num_blocks * block_size}, got {hi}"
            )


def check_paged_attention_values(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    num_tokens: int,
) -> None:
    """``paged_attention``: ``query_start_loc`` non-decreasing and ``<= T``, each sequence at least as long
    as its queries and fitting in ``max_blocks`` blocks. Reads values (see above)."""
    if not values_checkable(block_tables, seq_lens, query_start_loc):
        return
    op = "paged_attention"
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for n, seq_len in enumerate(lens):
        q_len = starts[n + 1] - starts[n]
        if q_len < 0 or starts[n + 1] > num_tokens:
            raise ValueError(
                f"{op}: query_start_loc must be non-decreasing and <= T={num_tokens}, got {starts}"
            )
        if seq_len < q_len:
            raise ValueError(f"{op}: seq_lens[{n}]={seq_len} is shorter than its {q_len} queries")
        if -(-seq_len // block_size) > block_tables.shape[1]:
            raise ValueError(
                f"{op}: seq_lens[{n}]={seq_len} needs more than max_blocks={block_tables.shape[1]} blocks"
            )
