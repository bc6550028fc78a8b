from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker

DEFAULT_EPS = 1e-6
"""The default ``eps`` of ``l2norm`` (FLA's), also the q/k norm of the gated delta rule (``use_qk_l2norm``)."""


def check_l2norm(x: torch.Tensor, eps: float) -> None:
    c = Checker("l2norm")
    c.tensor("x", x, ("...", "D"), FLOAT_DTYPES)
    c.positive_float("eps", eps)
