"""FP8 (e4m3): block-scaled weights (128x128, ``weight_scale_inv`` multipliers), dynamic per-token-group
activation quantisation, the block-scaled linear (alone, after the GDN output's gated RMS norm, or after the
decoder layer's residual add and zero-centred RMS norm), and per-tensor KV quantisation."""

from atom_kernels.ops.fp8.checks import (
    TICKET_COLUMNS,
    check_fp8_act_quant,
    check_fp8_block_dequant,
    check_fp8_kv_dequant,
    check_fp8_kv_quant,
    check_fp8_linear,
    check_gated_norm_fp8_linear,
    check_rms_norm_fp8_linear,
)

__all__ = [
    "check_fp8_act_quant",
    "check_fp8_block_dequant",
    "check_fp8_kv_dequant",
    "check_fp8_kv_quant",
    "check_fp8_linear",
    "check_gated_norm_fp8_linear",
    "check_rms_norm_fp8_linear",
    "TICKET_COLUMNS",
]
