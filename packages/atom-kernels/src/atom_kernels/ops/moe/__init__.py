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


def prefers_float32_weights(backend: str) -> bool:
    """Whether the ``moe_experts`` backend ``backend`` runs faster on float32 copies of bf16 weights held by
    their owner than on the bf16 weights: the reference (its float32 matmuls would convert them on every
    call), and the cpu backend unless its C pass multiplies bf16 by bf16 itself (AVX512-BF16 or AMX: bf16
    weights are half the bytes a call reads, and the float32 copies cost 2 bytes a weight)."""
    if backend == "reference":
        return True
    if backend == "cpu":
        from atom_kernels.ops.moe import cpu_native

        return not cpu_native.has_dpbf16()
    return False


__all__ = [
    "FLOAT32_WEIGHT_BACKENDS",
    "TICKET_COLUMNS",
    "TICKET_TOKENS",
    "check_moe_experts",
    "check_moe_router",
    "experts_fp8_tickets",
    "local_expert_ids",
    "prefers_float32_weights",
]
