from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker


def check_l2norm(x: torch.Tensor, eps: float) -> None:
    c = Checker("l2norm")
    c.tensor("x", x, ("...", "D"), FLOAT_DTYPES)
    c.positive_float("eps", eps)
