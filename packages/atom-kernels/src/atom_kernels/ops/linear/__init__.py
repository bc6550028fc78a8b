"""Dense linear: ``linear`` (``y = x @ weight.T + bias``, the unquantised projections)."""

from atom_kernels.ops.linear.checks import check_linear
from atom_kernels.ops.linear.cpu import pack_linear_weight

PACKED_WEIGHT_BACKENDS = ("cpu",)
"""The ``linear`` backends that take the weight packed once by :func:`pack_linear_weight` (keyword
``packed``) beside the weight itself."""

__all__ = ["PACKED_WEIGHT_BACKENDS", "check_linear", "pack_linear_weight"]
