"""Mixture of experts: ``moe_router`` (softmax top-k) and ``moe_experts`` (the routed SwiGLU experts)."""

from atom_kernels.ops.moe.checks import check_moe_experts, check_moe_router

__all__ = ["check_moe_experts", "check_moe_router"]
