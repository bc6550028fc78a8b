from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker


def check_silu_and_mul(x: torch.Tensor) -> None:
    c = Checker("silu_and_mul")
    c.tensor("x", x, ("...", "2I"), FLOAT_DTYPES)
    c.require(x.shape[-1] % 2 == 0, f"x's last dim must be even ([..., 2I]), got {tuple(x.shape)}")
