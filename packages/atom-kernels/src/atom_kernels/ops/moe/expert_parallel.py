"""Expert parallelism's id mapping: a rank that holds experts ``[first, first + count)`` of the model's runs
the router on every expert and passes ``moe_experts`` / ``moe_experts_fp8`` its local ids (-1 where the
router chose an expert held elsewhere: that slot contributes zero on this rank, and the ranks' partial
outputs sum to the full result)."""

from __future__ import annotations

import torch


def local_expert_ids(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """``ids - first`` where ``first <= ids < first + count``, else -1 (same shape and dtype as ``ids``).

    Elementwise on the device: no host synchronisation, capturable in a CUDA graph."""
    local = ids - first
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, -1))
