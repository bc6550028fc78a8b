"""Gated DeltaNet gating: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""

from atom_kernels.ops.gdn_gating.checks import check_gdn_gating

__all__ = ["check_gdn_gating"]
