"""L2 normalisation over the last dim (the GDN q/k norm)."""

from atom_kernels.ops.l2norm.checks import DEFAULT_EPS, check_l2norm

__all__ = ["DEFAULT_EPS", "check_l2norm"]
