"""Sparse MoE block of Qwen3-Next: top-k routed experts plus one shared expert with a sigmoid gate."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig
from torch import nn

from atom_models.modules import GatedMLP, Linear
from atom_models.parallel import SINGLE_PROCESS, ParallelContext, TPLayout
from atom_models.parallel.shard import check_every_rank


class Experts(nn.Module):
    """Routed experts stacked: ``w13[E, 2I, H]`` (rows ``[gate; up]``) and ``w2[E, H, I]``.

    ``I`` is this rank's ``intermediate_size``: rows ``intermediate_range`` (``[start, end)`` of the full
    ``moe_intermediate_size``) of every expert's gate and up projections, the same columns of its down
    projection (tensor parallel over the intermediate dimension; default: the whole of it). The output is
    this rank's partial sum; the MoE block all-reduces it.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype | None = None,
        intermediate_range: tuple[int, int] | None = None,
        full_intermediate_size: int | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_range = (0, intermediate_size) if intermediate_range is None else intermediate_range
        self.full_intermediate_size = (
            intermediate_size if full_intermediate_size is None else full_intermediate_size
        )
        if self.intermediate_range[1] - self.intermediate_range[0] != intermediate_size:
            raise ValueError(
                f"Experts: range {self.intermediate_range} does not hold {intermediate_size} rows"
            )
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False
        )

    def forward(self, kernels, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return kernels.moe_experts(x, weights, ids, self.w13, self.w2)


class Fp8Experts(nn.Module):
    """Routed experts with FP8 block-scaled weights, stacked: ``w13[E, 2I, H]`` and ``w2[E, H, I]``
    float8_e4m3fn; ``w13_scale_inv[E, 2 * ceil(I/bn), ceil(H/bk)]`` (the gate's row blocks, then the up
    projection's, each as in its checkpoint tensor) and ``w2_scale_inv[E, ceil(H/bn), ceil(I/bk)]`` float32.
    ``I`` and ``intermediate_range`` as in :class:`Experts`; every rank's range must start on a block
    boundary or lie inside one block (``ValueError`` otherwise, naming ``name``, on every rank).
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
    ):
        super().__init__()
        self.num_experts = num_experts
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
        self.block = (int(block[0]), int(block[1]))
        bn, bk = self.block
        e, h, i = num_experts, hidden_size, intermediate_size

        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        fp8 = torch.float8_e4m3fn
        self.w13 = param(e, 2 * i, h, dtype=fp8)
        self.w13_scale_inv = param(e, 2 * -(-i // bn), -(-h // bk), dtype=torch.float32)
        self.w2 = param(e, h, i, dtype=fp8)
        self.w2_scale_inv = param(e, -(-h // bn), -(-i // bk), dtype=torch.float32)

    def forward(self, kernels, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return kernels.moe_experts_fp8(
            x, weights, ids, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, self.block
        )


class SparseMoeBlock(nn.Module):
    """``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (HF ``Qwen3NextSparseMoeBlock``).

    Tensor parallel (``layout``): the router ``gate`` and ``shared_expert_gate`` are replicated (every rank
    routes every token, the same way); the routed experts and the shared expert are sharded over their
    intermediate dimension, so each rank's output is a partial sum of both; they are added (the sigmoid
    gate is a per-token scalar, so it applies to partial sums) and all-reduced ONCE per block. No token
    is moved between ranks (no all-to-all); expert parallelism is not implemented.
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
        # HF names the router "gate" (a Linear H -> E without bias).
        self.gate = Linear(config.hidden_size, config.num_experts, dtype=dtype)
        self.experts = Experts(
            config.num_experts,
            config.hidden_size,
            layout.moe_intermediate_size,
            dtype=dtype,
            intermediate_range=layout.row_range(config.moe_intermediate_size),
            full_intermediate_size=config.moe_intermediate_size,
        )
        self.shared_expert = (
            GatedMLP(
                config.hidden_size,
                config.shared_expert_intermediate_size,
                kernels,
                dtype=dtype,
                parallel=parallel,
                reduce_results=False,
            )
            if config.shared_expert_intermediate_size > 0
            else None
        )
        self.shared_expert_gate = (
            Linear(config.hidden_size, 1, dtype=dtype) if self.shared_expert is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernels
        weights, ids = k.moe_router(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(k, x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.parallel.all_reduce(out)
