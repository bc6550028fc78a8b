"""Sparse MoE block of Qwen3-Next: top-k routed experts plus one shared expert with a sigmoid gate."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig
from atom_kernels.ops.moe import experts_fp8_tickets, local_expert_ids, prefers_float32_weights
from torch import nn

from atom_models.modules import GatedMLP, Linear
from atom_models.parallel import SINGLE_PROCESS, ParallelContext, TPLayout
from atom_models.parallel.shard import check_every_rank


class Experts(nn.Module):
    """Routed experts stacked: ``w13[E + m, 2I, H]`` (rows ``[gate; up]``) and ``w2[E + m, H, I]``.

    ``I`` is this rank's ``intermediate_size``: rows ``intermediate_range`` (``[start, end)`` of the full
    ``moe_intermediate_size``) of every expert's gate and up projections, the same columns of its down
    projection (tensor parallel over the intermediate dimension; default: the whole of it). The output is
    this rank's partial sum; the MoE block all-reduces it.

    ``num_shared = m`` pseudo-experts ``E .. E + m - 1`` hold the shared expert (full intermediate size
    ``m * full_intermediate_size``): pseudo-expert j holds its gate and up rows and its down columns
    ``[j * I_full, (j + 1) * I_full)``, of which this rank holds ``intermediate_range`` shifted by
    ``j * I_full``. Their outputs sum to the shared expert's (SiLU-and-mul is per channel, down a sum over
    channels). ``num_experts`` is ``E``, the routed experts this module holds.

    Expert parallel (``expert_start = s``, not None): the module holds the model's experts ``[s, s + E)``
    whole; ``forward`` takes the router's global ids and maps them with ``local_expert_ids`` (-1, skipped
    by the op, for experts held on other ranks), so its output is this rank's partial sum. No shared
    pseudo-experts then (``num_shared`` must be 0). None: every expert, ids used as they are.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype | None = None,
        intermediate_range: tuple[int, int] | None = None,
        full_intermediate_size: int | None = None,
        num_shared: int = 0,
        expert_start: int | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.num_shared = num_shared
        self.expert_start = _check_expert_start(expert_start, num_shared)
        self.intermediate_range = (0, intermediate_size) if intermediate_range is None else intermediate_range
        self.full_intermediate_size = (
            intermediate_size if full_intermediate_size is None else full_intermediate_size
        )
        if self.intermediate_range[1] - self.intermediate_range[0] != intermediate_size:
            raise ValueError(
                f"Experts: range {self.intermediate_range} does not hold {intermediate_size} rows"
            )
        rows = num_experts + num_shared
        self.w13 = nn.Parameter(
            torch.empty(rows, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(rows, hidden_size, intermediate_size, dtype=dtype), requires_grad=False
        )

    def forward(self, kernels, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return kernels.moe_experts(x, weights, _local_ids(self, ids), self.w13, self.w2)

    def hold_float32(self) -> int:
        """Replace ``w13`` and ``w2`` by float32 copies of their (loaded) values, for a ``moe_experts``
        backend that :func:`~atom_kernels.ops.moe.prefers_float32_weights`: the products are the same, and
        the per-call conversion is gone. Returns the bytes this adds (already float32: 0)."""
        added = 0
        for name in ("w13", "w2"):
            w = getattr(self, name)
            if w.dtype != torch.float32:
                added += w.numel() * (4 - w.element_size())
                setattr(self, name, nn.Parameter(w.detach().float(), requires_grad=False))
        return added


def hold_float32_experts(model: nn.Module, kernels) -> int:
    """:meth:`Experts.hold_float32` on every :class:`Experts` of ``model`` where ``kernels`` binds
    ``moe_experts`` to a backend that :func:`~atom_kernels.ops.moe.prefers_float32_weights`; call once,
    after the weights are loaded. Returns the bytes added (0 where the backend does not hold them)."""
    if not prefers_float32_weights(kernels.backends.get("moe_experts", "")):
        return 0
    return sum(m.hold_float32() for m in model.modules() if isinstance(m, Experts))


def _check_expert_start(expert_start: int | None, num_shared: int) -> int | None:
    if expert_start is None:
        return None
    if isinstance(expert_start, bool) or not isinstance(expert_start, int) or expert_start < 0:
        raise ValueError(f"expert_start must be None or an int >= 0, got {expert_start!r}")
    if num_shared:
        raise ValueError("experts partitioned over ranks (expert_start) hold no shared pseudo-experts")
    return expert_start


def _local_ids(experts: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The router's ids as ``experts`` indexes them: unchanged, or (expert parallel) local, -1 elsewhere."""
    if experts.expert_start is None:
        return ids
    return local_expert_ids(ids, experts.expert_start, experts.num_experts)


class Fp8Experts(nn.Module):
    """Routed experts with FP8 block-scaled weights, stacked: ``w13[E + m, 2I, H]`` and ``w2[E + m, H, I]``
    float8_e4m3fn; ``w13_scale_inv[E + m, 2 * ceil(I/bn), ceil(H/bk)]`` (the gate's row blocks, then the up
    projection's, each as in its checkpoint tensor) and ``w2_scale_inv[E + m, ceil(H/bn), ceil(I/bk)]``
    float32. ``I``, ``intermediate_range``, ``expert_start`` and the ``num_shared = m`` pseudo-experts as
    in :class:`Experts`;
    a pseudo-expert whose rows lie inside one scale block of the shared expert's tensor holds a copy of that
    block's scales. Every rank's range (of every pseudo-expert too) must start on a block boundary or lie
    inside one block (``ValueError`` otherwise, naming ``name``, on every rank).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        block: tuple[int, int],
        device: torch.device | None = None,
        intermediate_range: tuple[int, int] | None = None,
        full_intermediate_size: int | None = None,
        name: str = "experts",
        num_shared: int = 0,
        expert_start: int | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.num_shared = num_shared
        self.expert_start = _check_expert_start(expert_start, num_shared)
        self.intermediate_range = (0, intermediate_size) if intermediate_range is None else intermediate_range
        self.full_intermediate_size = (
            intermediate_size if full_intermediate_size is None else full_intermediate_size
        )
        world_size = self.full_intermediate_size // max(intermediate_size, 1)
        s, e = self.intermediate_range
        if e - s != intermediate_size:
            raise ValueError(
                f"{name}: range {self.intermediate_range} does not hold {intermediate_size} rows"
            )
        full = self.full_intermediate_size  # every rank's range checked: the same verdict on every rank
        check_every_rank(name, full, intermediate_size, int(block[0]), "rows", world_size)  # gate / up rows
        check_every_rank(name, full, intermediate_size, int(block[1]), "columns", world_size)  # down columns
        if num_shared:  # every rank's range of every pseudo-expert, in the shared expert's tensors
            shared = full * num_shared
            check_every_rank(name, shared, intermediate_size, int(block[0]), "rows", world_size)
            check_every_rank(name, shared, intermediate_size, int(block[1]), "columns", world_size)
        self.block = (int(block[0]), int(block[1]))
        bn, bk = self.block
        e, h, i = num_experts + num_shared, hidden_size, intermediate_size

        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        fp8 = torch.float8_e4m3fn
        self.w13 = param(e, 2 * i, h, dtype=fp8)
        self.w13_scale_inv = param(e, 2 * -(-i // bn), -(-h // bk), dtype=torch.float32)
        self.w2 = param(e, h, i, dtype=fp8)
        self.w2_scale_inv = param(e, -(-h // bn), -(-i // bk), dtype=torch.float32)
        # the op's per-(token, column tile) counters for its in-kernel routed sum (int32 zeros, left zero by
        # every launch): owned here so that no launch has to zero fresh ones (runtime state, not in the
        # state dict)
        self.register_buffer(
            "tickets",
            torch.zeros(experts_fp8_tickets(h), dtype=torch.int32, device=device),
            persistent=False,
        )

    def forward(self, kernels, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return kernels.moe_experts_fp8(
            x,
            weights,
            _local_ids(self, ids),
            self.w13,
            self.w13_scale_inv,
            self.w2,
            self.w2_scale_inv,
            self.block,
            tickets=self.tickets,
        )


def shared_pseudo_experts(config: Qwen3NextConfig) -> int:
    """1 when the shared expert is stored as one pseudo-expert after the routed ones (its intermediate size
    equals ``moe_intermediate_size``, as in the published Qwen3-Next checkpoints); 0 otherwise (then
    :class:`SparseMoeBlock` keeps a separate :class:`GatedMLP`).

    A shared expert of ``m > 1`` expert sizes could be ``m`` pseudo-experts (the storage, loader and kernels
    take any ``m``), but the fold changes the bf16 rounding (``m`` partial down-projections, the sigmoid
    weight applied in float32 inside the expert sum), which moved the bundled tiny model's (``Is = 2 I``)
    vLLM acceptance below the plugin's bar against stock vLLM (docs/performance.md, "Standalone engine"),
    so such configs keep the unfused block. The fold exists for the launch count of the ``Is == I`` shape."""
    shared, inter = config.shared_expert_intermediate_size, config.moe_intermediate_size
    return 1 if shared > 0 and shared == inter else 0


# Rows of the folded router: E + 1 rounded up to this multiple, the shared gate row repeated in the extra
# rows. An output row of E + 1 = 513 bf16 logits is not 16-byte aligned, and cuBLAS then falls back to a
# slower kernel (H200, 80B shapes at 2 tokens: 9.8 us over 513 columns, 5.4 us over 512).
ROUTER_ROW_MULTIPLE = 8


def router_rows(config: Qwen3NextConfig) -> int:
    """Rows of :class:`SparseMoeBlock`'s router: ``E``, or folded ``E + 1`` rounded up to
    ``ROUTER_ROW_MULTIPLE``."""
    e = config.num_experts
    if not shared_pseudo_experts(config):
        return e
    return -(-(e + 1) // ROUTER_ROW_MULTIPLE) * ROUTER_ROW_MULTIPLE


class SparseMoeBlock(nn.Module):
    """``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (HF ``Qwen3NextSparseMoeBlock``).

    Folded form (``num_shared = m > 0``, :func:`shared_pseudo_experts`): the shared expert is ``m``
    pseudo-experts after the routed ones (:class:`Experts`), and the router ``gate`` is one Linear
    ``H -> R`` (:func:`router_rows`: the routed experts' rows, then ``shared_expert_gate``'s row, repeated
    up to ``R``): ``moe_gate_router(x, gate.weight, E, top_k, renormalize, num_shared=m)`` (the Linear and
    ``moe_router`` over its first ``E + 1`` columns, in one launch at decode sizes) routes every token
    to the pseudo-experts with
    weight ``sigmoid(logit E)``, and one ``moe_experts`` call computes routed and shared experts together.
    Otherwise (``Is != I``) the shared expert is a separate :class:`GatedMLP` with its own
    ``shared_expert_gate``; without a shared expert (``Is == 0``) only the routed experts.

    Tensor parallel (``layout``): the router is replicated (every rank routes every token, the same way);
    the routed experts and the shared expert are sharded over their intermediate dimension (each
    pseudo-expert as a routed one), so each rank's output is a partial sum (the sigmoid gate is a
    per-token scalar, so it applies to partial sums), all-reduced ONCE per block. No token is moved between
    ranks (no all-to-all).

    Expert parallel (``layout.expert_parallel``): rank r holds ``layout.num_local_experts`` routed experts
    from ``layout.expert_start`` on, whole (:class:`Experts` with ``expert_start``); the router still
    scores all ``E`` experts on every rank, each rank computes the slots routed to its experts, and the
    same one all-reduce sums the partial outputs. The shared expert is not folded then (a separate
    :class:`GatedMLP`, split over its intermediate dimension, with its own ``shared_expert_gate``).
    """

    def __init__(
        self,
        config: Qwen3NextConfig,
        kernels,
        dtype: torch.dtype | None = None,
        layout: TPLayout | None = None,
        parallel: ParallelContext = SINGLE_PROCESS,
    ):
        super().__init__()
        layout = TPLayout.of(config, parallel, layout)
        self.kernels = kernels
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.num_experts = config.num_experts  # the router's E (all of the model's routed experts)
        ep = layout.expert_parallel
        self.num_shared = 0 if ep else shared_pseudo_experts(config)
        # HF names the router "gate" (a Linear H -> E without bias); folded: H -> router_rows(config).
        # (read by moe_gate_router as it is, never through the packed product: not packed)
        router = config.num_experts if ep else router_rows(config)
        self.gate = Linear(config.hidden_size, router, dtype=dtype, pack=False)
        self.experts = Experts(
            layout.num_local_experts,
            config.hidden_size,
            layout.moe_intermediate_size,
            dtype=dtype,
            intermediate_range=(0, config.moe_intermediate_size)
            if ep
            else layout.row_range(config.moe_intermediate_size),
            full_intermediate_size=config.moe_intermediate_size,
            num_shared=self.num_shared,
            expert_start=layout.expert_start if ep else None,
        )
        separate = config.shared_expert_intermediate_size > 0 and not self.num_shared
        self.shared_expert = (
            GatedMLP(
                config.hidden_size,
                config.shared_expert_intermediate_size,
                kernels,
                dtype=dtype,
                parallel=parallel,
                reduce_results=False,
            )
            if separate
            else None
        )
        self.shared_expert_gate = Linear(config.hidden_size, 1, dtype=dtype) if separate else None
        # moe_gate_router's grid-wide counter (int32 zero, left zero by every launch; runtime state)
        self.register_buffer("router_tickets", torch.zeros(1, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernels
        e = self.num_experts
        if isinstance(self.gate, Linear) and self.gate.bias is None and self.gate.shard is None:
            weights, ids = k.moe_gate_router(
                x,
                self.gate.weight,
                e,
                self.top_k,
                self.renormalize,
                self.num_shared,
                tickets=self.router_tickets,
            )
        else:  # a router the checkpoint quantises (Fp8Linear), or with a bias: its own linear, then the router
            logits = self.gate(x)[:, : e + (1 if self.num_shared else 0)]
            weights, ids = k.moe_router(logits, self.top_k, self.renormalize, num_shared=self.num_shared)
        out = self.experts(k, x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.parallel.all_reduce(out)
