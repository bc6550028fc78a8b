"""Mixture of experts: ``moe_router`` (softmax top-k) and ``moe_experts`` (the routed SwiGLU experts);
``local_expert_ids`` maps the router's ids to one expert-parallel rank's."""

from atom_kernels.ops.moe.checks import (
    TICKET_COLUMNS,
    TICKET_TOKENS,
    check_moe_experts,
    check_moe_router,
    experts_fp8_tickets,
)
from atom_kernels.ops.moe.expert_parallel import local_expert_ids

FLOAT32_WEIGHT_BACKENDS = ("reference", "cpu")
"""The ``moe_experts`` backends that also take ``w13`` / ``w2`` as float32 copies of x.dtype weights (their
products are float32 sums of x.dtype operands: float32 copies held once replace a per-call conversion)."""

__all__ = [
    "FLOAT32_WEIGHT_BACKENDS",
    "TICKET_COLUMNS",
    "TICKET_TOKENS",
    "check_moe_experts",
    "check_moe_router",
    "experts_fp8_tickets",
    "local_expert_ids",
]
