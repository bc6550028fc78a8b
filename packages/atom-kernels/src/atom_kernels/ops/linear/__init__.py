"""Dense linear: ``linear`` (``y = x @ weight.T + bias``, the unquantised projections)."""

from atom_kernels.ops.linear.checks import check_linear

__all__ = ["check_linear"]
