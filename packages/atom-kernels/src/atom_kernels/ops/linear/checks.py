from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    c = Checker("linear")
    c.tensor("x", x, ("...", "K"), FLOAT_DTYPES)
    c.tensor("weight", weight, ("N", "K"), (x.dtype,))
    c.optional("bias", bias, ("N",), (x.dtype,))
