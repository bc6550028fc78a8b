from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker


def check_moe_router(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    c = Checker("moe_router")
    c.tensor("logits", logits, ("T", "E"), FLOAT_DTYPES)
    c.positive_int("top_k", top_k)
    c.require(top_k <= c.dim("E"), f"top_k must be <= E={c.dim('E')}, got {top_k}")
    c.require(isinstance(renormalize, bool), f"renormalize must be a bool, got {renormalize!r}")


def check_moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> None:
    c = Checker("moe_experts")
    c.tensor("x", x, ("T", "H"), FLOAT_DTYPES)
    c.tensor("weights", weights, ("T", "K"), FLOAT_DTYPES)
    c.tensor("ids", ids, ("T", "K"), (torch.int64, torch.int32))
    c.tensor("w13", w13, ("E", "2I", "H"), (x.dtype,))
    c.require(c.dim("2I") % 2 == 0, f"w13 must have shape [E, 2I, H] with an even 2I, got {tuple(w13.shape)}")
    c.dims["I"] = c.dim("2I") // 2
    c.tensor("w2", w2, ("E", "H", "I"), (x.dtype,))
