from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker


def check_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float
) -> None:
    c = Checker("rope")
    c.tensor("q", q, ("T", "Hq", "D"), FLOAT_DTYPES)
    c.tensor("k", k, ("T", "Hk", "D"), FLOAT_DTYPES)
    c.tensor("positions", positions, ("T",), (torch.int64,))
    c.positive_int("rotary_dim", rotary_dim)
    c.require(
        rotary_dim % 2 == 0 and rotary_dim <= c.dim("D"),
        f"rotary_dim must be even and <= D={c.dim('D')}, got {rotary_dim}",
    )
    c.positive_float("theta", theta)
