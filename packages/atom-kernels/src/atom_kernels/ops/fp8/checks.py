from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, FP8_DTYPES, Checker
from atom_kernels.ops.paged_attention.checks import check_scale

# ``fp8_linear``'s ``tickets``: one counter per this many output columns (the narrowest column tile a
# split-K plan may use), so ``ceil(N / TICKET_COLUMNS)`` counters serve every plan.
TICKET_COLUMNS = 16


def _block(c: Checker, block: object) -> tuple[int, int]:
    ok = isinstance(block, (tuple, list)) and len(block) == 2
    ok = ok and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)  # type: ignore[union-attr]
    c.require(ok, f"block must be a pair of positive ints (bn, bk), got {block!r}")
    return int(block[0]), int(block[1])  # type: ignore[index]


def _weight(c: Checker, w: torch.Tensor, scale_inv: torch.Tensor, block: object) -> None:
    c.tensor("w", w, ("N", "K"), FP8_DTYPES)
    bn, bk = _block(c, block)
    c.dims["ceil(N/bn)"] = -(-c.dim("N") // bn)
    c.dims["ceil(K/bk)"] = -(-c.dim("K") // bk)
    c.tensor("scale_inv", scale_inv, ("ceil(N/bn)", "ceil(K/bk)"), (torch.float32, torch.bfloat16))


def check_fp8_block_dequant(w: torch.Tensor, scale_inv: torch.Tensor, block: object, dtype: object) -> None:
    c = Checker("fp8_block_dequant")
    _weight(c, w, scale_inv, block)
    c.require(dtype in FLOAT_DTYPES, f"dtype must be one of {list(FLOAT_DTYPES)}, got {dtype!r}")


def check_fp8_act_quant(x: torch.Tensor, group: int) -> None:
    c = Checker("fp8_act_quant")
    c.tensor("x", x, ("...", "K"), FLOAT_DTYPES)
    c.positive_int("group", group)


def check_fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: object,
    bias: torch.Tensor | None,
    tickets: torch.Tensor | None = None,
) -> None:
    c = Checker("fp8_linear")
    c.tensor("w_fp8", w_fp8, ("N", "K"), FP8_DTYPES)
    c.tensor("x", x, ("...", "K"), FLOAT_DTYPES)
    _weight(c, w_fp8, scale_inv, block)
    c.optional("bias", bias, ("N",), FLOAT_DTYPES)
    c.optional("tickets", tickets, ("C",), (torch.int32,))
    if tickets is not None:
        c.require(tickets.is_contiguous(), "tickets must be contiguous")
        need = -(-w_fp8.shape[0] // TICKET_COLUMNS)
        c.require(
            tickets.numel() >= need,
            f"tickets holds {tickets.numel()} counters, needs >= {need} (N / {TICKET_COLUMNS})",
        )


def check_gated_norm_fp8_linear(
    o: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: object,
    bias: torch.Tensor | None,
    tickets: torch.Tensor | None = None,
) -> None:
    c = Checker("gated_norm_fp8_linear")
    c.tensor("o", o, ("...", "Hv", "Dv"), FLOAT_DTYPES)
    c.tensor("z", z, tuple(o.shape), FLOAT_DTYPES)
    c.tensor("norm_weight", norm_weight, ("Dv",), FLOAT_DTYPES)
    c.positive_float("eps", eps)
    c.dims["Hv*Dv"] = c.dim("Hv") * c.dim("Dv")
    c.tensor("w_fp8", w_fp8, ("N", "Hv*Dv"), FP8_DTYPES)
    check_fp8_linear(o.flatten(-2), w_fp8, scale_inv, block, bias, tickets)


def check_rms_norm_fp8_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: object,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    tickets: torch.Tensor | None = None,
) -> None:
    c = Checker("rms_norm_fp8_linear")
    c.tensor("x", x, ("...", "K"), FLOAT_DTYPES)
    c.tensor("norm_weight", norm_weight, ("K",), FLOAT_DTYPES)
    c.positive_float("eps", eps)
    if residual is not None:
        c.tensor("residual", residual, tuple(x.shape), FLOAT_DTYPES)
        c.require(
            residual.dtype in (x.dtype, torch.float32),
            f"residual must have x's dtype {x.dtype} or float32, got {residual.dtype}",
        )
    c.tensor("w_fp8", w_fp8, ("N", "K"), FP8_DTYPES)
    check_fp8_linear(x, w_fp8, scale_inv, block, bias, tickets)


def check_fp8_kv_quant(x: torch.Tensor, scale: object) -> None:
    c = Checker("fp8_kv_quant")
    c.tensor("x", x, ("...",), FLOAT_DTYPES)
    check_scale(c, "scale", scale)
    c.require(scale is not None, "scale must be given (a positive float or a one-element float32 tensor)")


def check_fp8_kv_dequant(x_fp8: torch.Tensor, scale: object, dtype: object) -> None:
    c = Checker("fp8_kv_dequant")
    c.tensor("x_fp8", x_fp8, ("...",), FP8_DTYPES)
    check_scale(c, "scale", scale)
    c.require(scale is not None, "scale must be given (a positive float or a one-element float32 tensor)")
    c.require(dtype in FLOAT_DTYPES, f"dtype must be one of {list(FLOAT_DTYPES)}, got {dtype!r}")
