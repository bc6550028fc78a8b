"""Sparse MoE block of Qwen3-Next: top-k routed experts plus one shared expert with a sigmoid gate."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig
from torch import nn

from atom_models.modules import GatedMLP, Linear


class Experts(nn.Module):
    """Routed experts stacked: ``w13[E, 2I, H]`` (rows ``[gate; up]``) and ``w2[E, H, I]``."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.num_experts = num_experts
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False
        )


class SparseMoeBlock(nn.Module):
    """``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (HF ``Qwen3NextSparseMoeBlock``)."""

    def __init__(self, config: Qwen3NextConfig, kernels, dtype: torch.dtype | None = None):
        super().__init__()
        self.kernels = kernels
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        # HF names the router "gate" (a Linear H -> E without bias).
        self.gate = Linear(config.hidden_size, config.num_experts, dtype=dtype)
        self.experts = Experts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, dtype=dtype
        )
        self.shared_expert = (
            GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, kernels, dtype=dtype)
            if config.shared_expert_intermediate_size > 0
            else None
        )
        self.shared_expert_gate = (
            Linear(config.hidden_size, 1, dtype=dtype) if self.shared_expert is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernels
        weights, ids = k.moe_router(self.gate(x), self.top_k, self.renormalize)
        out = k.moe_experts(x, weights, ids, self.experts.w13, self.experts.w2)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
