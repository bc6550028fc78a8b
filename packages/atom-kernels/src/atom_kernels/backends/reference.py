"""The ``reference`` backend: plain torch, any device, the semantic spec every backend must match.

Imported by ``import atom_kernels``; priority 0 so any available faster backend wins by default.
"""

from __future__ import annotations

from atom_kernels.ops.activation import reference as activation
from atom_kernels.ops.moe import reference as moe
from atom_kernels.ops.norm import reference as norm
from atom_kernels.ops.rope import reference as rope
from atom_kernels.registry import always_available, register

BACKEND = "reference"
PRIORITY = 0

REFERENCE_OPS = {
    "rms_norm": norm.rms_norm,
    "gated_rms_norm": norm.gated_rms_norm,
    "rope": rope.rope,
    "silu_and_mul": activation.silu_and_mul,
    "moe_router": moe.moe_router,
    "moe_experts": moe.moe_experts,
}

for _op, _fn in REFERENCE_OPS.items():
    register(_op, BACKEND, _fn, available=always_available, priority=PRIORITY)
