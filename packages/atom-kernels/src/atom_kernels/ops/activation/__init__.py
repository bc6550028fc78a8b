"""Activations: ``silu_and_mul`` (the gated MLP's SwiGLU)."""

from atom_kernels.ops.activation.checks import check_silu_and_mul

__all__ = ["check_silu_and_mul"]
