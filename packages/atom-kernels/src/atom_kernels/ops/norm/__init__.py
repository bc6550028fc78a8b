"""RMS norms: ``rms_norm`` (zero-centred weight, optional fused residual add) and ``gated_rms_norm``."""

from atom_kernels.ops.norm.checks import check_gated_rms_norm, check_rms_norm

__all__ = ["check_gated_rms_norm", "check_rms_norm"]
