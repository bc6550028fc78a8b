from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> None:
    c = Checker("rms_norm")
    c.tensor("x", x, ("...", "H"), FLOAT_DTYPES)
    c.tensor("weight", weight, ("H",), FLOAT_DTYPES)
    c.positive_float("eps", eps)
    if residual is not None:
        c.tensor("residual", residual, tuple(x.shape), FLOAT_DTYPES)
        c.require(
            residual.dtype in (x.dtype, torch.float32),
            f"residual must have x's dtype {x.dtype} or float32, got {residual.dtype}",
        )


def check_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    c = Checker("gated_rms_norm")
    c.tensor("x", x, ("...", "Dv"), FLOAT_DTYPES)
    c.tensor("z", z, tuple(x.shape), FLOAT_DTYPES)
    c.tensor("weight", weight, ("Dv",), FLOAT_DTYPES)
    c.positive_float("eps", eps)
