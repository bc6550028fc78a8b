"""Paged KV cache: ``kv_cache_write`` (scatter K/V into blocks, optional fp8) and ``paged_attention``
(mixed prefill / decode / verify batches, GQA)."""

from atom_kernels.ops.paged_attention.checks import check_kv_cache_write, check_paged_attention

__all__ = ["check_kv_cache_write", "check_paged_attention"]
