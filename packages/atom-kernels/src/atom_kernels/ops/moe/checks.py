from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, FP8_DTYPES, Checker

# ``moe_experts_fp8``'s ``tickets``: one counter per (token, column tile) of a launch that sums the experts'
# outputs in place, for up to TICKET_TOKENS tokens and column tiles of at least TICKET_COLUMNS channels
# (the narrowest tile a tensor-core dot takes), so ``experts_fp8_tickets(H)`` counters serve every plan.
TICKET_TOKENS = 8
TICKET_COLUMNS = 16


def experts_fp8_tickets(hidden_size: int) -> int:
    """How many int32 counters ``moe_experts_fp8``'s ``tickets`` must hold for hidden size ``H``:
    ``TICKET_TOKENS * ceil(H / TICKET_COLUMNS)``."""
    return TICKET_TOKENS * -(-int(hidden_size) // TICKET_COLUMNS)


def check_moe_router(logits: torch.Tensor, top_k: int, renormalize: bool, num_shared: int = 0) -> int:
    """Returns the number of routed experts ``E`` (``logits`` is ``[T, E]``, or ``[T, E + 1]`` with
    ``num_shared > 0``)."""
    c = Checker("moe_router")
    ok = isinstance(num_shared, int) and not isinstance(num_shared, bool) and num_shared >= 0
    c.require(ok, f"num_shared must be an int >= 0, got {num_shared!r}")
    c.tensor("logits", logits, ("T", "E + 1" if num_shared else "E"), FLOAT_DTYPES)
    num_experts = logits.shape[1] - (1 if num_shared else 0)
    c.require(
        num_experts >= 1, f"logits must hold at least one routed expert column, got {tuple(logits.shape)}"
    )
    c.dims["E"] = num_experts
    c.positive_int("top_k", top_k)
    c.require(top_k <= c.dim("E"), f"top_k must be <= E={c.dim('E')}, got {top_k}")
    c.require(isinstance(renormalize, bool), f"renormalize must be a bool, got {renormalize!r}")
    return num_experts


def check_moe_gate_router(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    renormalize: bool,
    num_shared: int,
    tickets: torch.Tensor | None,
) -> int:
    """Returns the logit columns the router reads: ``E``, or ``E + 1`` with ``num_shared > 0``."""
    c = Checker("moe_gate_router")
    ok = isinstance(num_shared, int) and not isinstance(num_shared, bool) and num_shared >= 0
    c.require(ok, f"num_shared must be an int >= 0, got {num_shared!r}")
    c.positive_int("num_experts", num_experts)
    c.tensor("x", x, ("T", "H"), FLOAT_DTYPES)
    c.tensor("gate_weight", gate_weight, ("R", "H"), (x.dtype,))
    cols = num_experts + (1 if num_shared else 0)
    c.require(
        c.dim("R") >= cols,
        f"gate_weight has {c.dim('R')} rows, needs >= {cols} (E = {num_experts} routed"
        f"{' + the shared gate' if num_shared else ''})",
    )
    c.positive_int("top_k", top_k)
    c.require(top_k <= num_experts, f"top_k must be <= E={num_experts}, got {top_k}")
    c.require(isinstance(renormalize, bool), f"renormalize must be a bool, got {renormalize!r}")
    c.optional("tickets", tickets, ("C",), (torch.int32,))
    if tickets is not None:
        c.require(tickets.numel() >= 1, "tickets must hold at least one counter")
        c.require(tickets.device == x.device, f"tickets on {tickets.device}, x on {x.device}")
    return cols


def check_moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    float32_weights: bool = False,
) -> None:
    """``float32_weights``: the backend also takes ``w13`` / ``w2`` in float32 for a lower-precision ``x``
    (float32 copies of x.dtype weights, made once by their owner; see ``moe.cpu``)."""
    c = Checker("moe_experts")
    c.tensor("x", x, ("T", "H"), FLOAT_DTYPES)
    c.tensor("weights", weights, ("T", "K"), FLOAT_DTYPES)
    c.tensor("ids", ids, ("T", "K"), (torch.int64, torch.int32))
    w_dtypes = (x.dtype, torch.float32) if float32_weights else (x.dtype,)
    c.tensor("w13", w13, ("E", "2I", "H"), w_dtypes)
    c.require(c.dim("2I") % 2 == 0, f"w13 must have shape [E, 2I, H] with an even 2I, got {tuple(w13.shape)}")
    c.dims["I"] = c.dim("2I") // 2
    c.tensor("w2", w2, ("E", "H", "I"), (w13.dtype,))


def check_moe_experts_fp8(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    block: object,
    tickets: torch.Tensor | None = None,
) -> None:
    c = Checker("moe_experts_fp8")
    c.tensor("x", x, ("T", "H"), FLOAT_DTYPES)
    c.tensor("weights", weights, ("T", "K"), FLOAT_DTYPES)
    c.tensor("ids", ids, ("T", "K"), (torch.int64, torch.int32))
    c.tensor("w13", w13, ("E", "2I", "H"), FP8_DTYPES)
    c.require(c.dim("2I") % 2 == 0, f"w13 must have shape [E, 2I, H] with an even 2I, got {tuple(w13.shape)}")
    c.dims["I"] = c.dim("2I") // 2
    c.tensor("w2", w2, ("E", "H", "I"), FP8_DTYPES)
    ok = isinstance(block, (tuple, list)) and len(block) == 2
    ok = ok and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)  # type: ignore[union-attr]
    c.require(ok, f"block must be a pair of positive ints (bn, bk), got {block!r}")
    bn, bk = int(block[0]), int(block[1])  # type: ignore[index]
    c.dims["2*ceil(I/bn)"] = 2 * -(-c.dim("I") // bn)
    c.dims["ceil(H/bk)"] = -(-c.dim("H") // bk)
    c.dims["ceil(H/bn)"] = -(-c.dim("H") // bn)
    c.dims["ceil(I/bk)"] = -(-c.dim("I") // bk)
    c.tensor("w13_scale", w13_scale, ("E", "2*ceil(I/bn)", "ceil(H/bk)"), (torch.float32,))
    c.tensor("w2_scale", w2_scale, ("E", "ceil(H/bn)", "ceil(I/bk)"), (torch.float32,))
    c.optional("tickets", tickets, ("C",), (torch.int32,))
    if tickets is not None:
        c.require(tickets.is_contiguous(), "tickets must be contiguous")
        need = experts_fp8_tickets(c.dim("H"))
        c.require(
            tickets.numel() >= need,
            f"tickets holds {tickets.numel()} counters, needs >= {need} "
            f"({TICKET_TOKENS} * ceil(H={c.dim('H')} / {TICKET_COLUMNS}))",
        )
