from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker


def check_gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor) -> None:
    c = Checker("gdn_gating")
    c.tensor("a", a, ("T", "Hv"), FLOAT_DTYPES)
    c.tensor("b", b, ("T", "Hv"), FLOAT_DTYPES)
    c.tensor("A_log", A_log, ("Hv",), FLOAT_DTYPES)
    c.tensor("dt_bias", dt_bias, ("Hv",), FLOAT_DTYPES)
