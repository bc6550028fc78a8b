"""The ``reference`` backend: plain torch, any device, the semantic spec every backend must match.

Imported by ``import atom_kernels``; priority 0 so any available faster backend wins by default.
"""

from __future__ import annotations

from atom_kernels.ops.activation import reference as activation
from atom_kernels.ops.conv1d import reference as conv1d
from atom_kernels.ops.copy_rows import reference as copy_rows
from atom_kernels.ops.fp8 import reference as fp8
from atom_kernels.ops.gated_delta_rule import reference as gdr
from atom_kernels.ops.gdn_gating import reference as gdn_gating
from atom_kernels.ops.l2norm import reference as l2norm
from atom_kernels.ops.linear import reference as linear
from atom_kernels.ops.moe import reference as moe
from atom_kernels.ops.norm import reference as norm
from atom_kernels.ops.paged_attention import reference as paged
from atom_kernels.ops.rope import reference as rope
from atom_kernels.registry import always_available, register

BACKEND = "reference"
PRIORITY = 0

REFERENCE_OPS = {
    "rms_norm": norm.rms_norm,
    "gated_rms_norm": norm.gated_rms_norm,
    "rope": rope.rope,
    "silu_and_mul": activation.silu_and_mul,
    "linear": linear.linear,
    "moe_router": moe.moe_router,
    "moe_gate_router": moe.moe_gate_router,
    "moe_experts": moe.moe_experts,
    "moe_experts_fp8": moe.moe_experts_fp8,
    "gdn_gating": gdn_gating.gdn_gating,
    "l2norm": l2norm.l2norm,
    "causal_conv1d_varlen": conv1d.causal_conv1d_varlen,
    "causal_conv1d_update": conv1d.causal_conv1d_update,
    "gated_delta_rule_chunked": gdr.gated_delta_rule_chunked,
    "gated_delta_rule_recurrent": gdr.gated_delta_rule_recurrent,
    "gated_delta_rule_verify": gdr.gated_delta_rule_verify,
    "kv_cache_write": paged.kv_cache_write,
    "paged_attention": paged.paged_attention,
    "fp8_block_dequant": fp8.fp8_block_dequant,
    "fp8_act_quant": fp8.fp8_act_quant,
    "fp8_linear": fp8.fp8_linear,
    "gated_norm_fp8_linear": fp8.gated_norm_fp8_linear,
    "rms_norm_fp8_linear": fp8.rms_norm_fp8_linear,
    "fp8_kv_quant": fp8.fp8_kv_quant,
    "fp8_kv_dequant": fp8.fp8_kv_dequant,
    "copy_rows": copy_rows.copy_rows,
}

for _op, _fn in REFERENCE_OPS.items():
    register(_op, BACKEND, _fn, available=always_available, priority=PRIORITY)
