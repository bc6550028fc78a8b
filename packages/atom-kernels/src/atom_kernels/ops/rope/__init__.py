"""Rotary position embedding, neox layout, partial rotary."""

from atom_kernels.ops.rope.checks import check_rope

__all__ = ["check_rope"]
