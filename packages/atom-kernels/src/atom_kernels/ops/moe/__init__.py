"""Mixture of experts: ``moe_router`` (softmax top-k) and ``moe_experts`` (the routed SwiGLU experts)."""

from atom_kernels.ops.moe.checks import (
    TICKET_COLUMNS,
    TICKET_TOKENS,
    check_moe_experts,
    check_moe_router,
    experts_fp8_tickets,
)

__all__ = ["TICKET_COLUMNS", "TICKET_TOKENS", "check_moe_experts", "check_moe_router", "experts_fp8_tickets"]
