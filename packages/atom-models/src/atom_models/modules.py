"""Small building blocks shared by the Qwen3-Next target and the MTP draft.

Weights are allocated with ``torch.empty`` (no random init: every parameter comes from the checkpoint and
the loader checks that every one was written). Numeric ops come from the injected ``Kernels``.
"""

from __future__ import annotations

import torch
from atom_kernels.ops.fp8 import TICKET_COLUMNS
from torch import nn

from atom_models.parallel.context import SINGLE_PROCESS, ParallelContext
from atom_models.parallel.linear import (
    Linear,
    column_parallel_linear,
    finish,
    local_bias,
    row_parallel_linear,
)
from atom_models.parallel.shard import COLUMN, LinearShard

__all__ = ["column_parallel_linear", "Fp8Linear", "GatedMLP", "Linear", "RMSNorm", "row_parallel_linear"]


class Fp8Linear(nn.Module):
    """``y = kernels.fp8_linear(x, weight, weight_scale_inv, block, bias)``: a W8A8 block-scaled linear.

    ``weight`` is ``[out_features, in_features]`` float8_e4m3fn and ``weight_scale_inv`` its float32 block
    multipliers (the checkpoint's names); activations are quantised per token and group of ``bk`` channels
    inside the op. ``bias`` (optional) is in ``dtype``. ``shard`` as for :class:`Linear` (the collective
    after the matmul is the same).

    Scale rows: a fused weight (``shard.parts``, e.g. ``[gate; up]``) keeps each part's own row blocks,
    ``sum(ceil(rows_i / bn))`` rows stacked in part order, as the checkpoint tensors hold them. When a part
    other than the last does not fill whole blocks (the fused weight's local blocks would straddle two
    parts), ``forward`` multiplies part by part and concatenates.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        block: tuple[int, int],
        kernels,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        shard: LinearShard | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = (int(block[0]), int(block[1]))
        self.kernels = kernels
        self.shard = shard
        bn, bk = self.block
        row_parts = shard.local_parts if shard is not None and shard.kind == COLUMN else (out_features,)
        if sum(row_parts) != out_features:
            raise ValueError(f"Fp8Linear: shard parts {row_parts} do not add up to {out_features} rows")
        self.row_parts = tuple(row_parts)
        # (rows [r0, r1), scale rows [s0, s1)) per part, only when a part boundary falls inside a block
        spans, r0, s0 = [], 0, 0
        for n in row_parts:
            spans.append((r0, r0 + n, s0, s0 + -(-n // bn)))
            r0, s0 = r0 + n, s0 + -(-n // bn)
        aligned = all(n % bn == 0 for n in row_parts[:-1])
        self.part_spans: tuple[tuple[int, int, int, int], ...] | None = None if aligned else tuple(spans)
        rows, cols = s0, -(-in_features // bk)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
            requires_grad=False,
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(rows, cols, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        # the op's split-K counters (int32 zeros, left zero by every launch): owned here so that no launch
        # has to zero fresh ones (runtime state, not in the state dict)
        self.register_buffer(
            "tickets",
            torch.zeros(-(-out_features // TICKET_COLUMNS), dtype=torch.int32, device=device),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = local_bias(self.bias, self.shard)
        if self.part_spans is None:
            y = self.kernels.fp8_linear(
                x, self.weight, self.weight_scale_inv, self.block, bias, tickets=self.tickets
            )
        else:
            y = torch.cat(
                [
                    self.kernels.fp8_linear(
                        x,
                        self.weight[r0:r1],
                        self.weight_scale_inv[s0:s1],
                        self.block,
                        None if bias is None else bias[r0:r1],
                        tickets=self.tickets,
                    )
                    for r0, r1, s0, s1 in self.part_spans
                ],
                dim=-1,
            )
        return finish(y, self.shard)

    @property
    def takes_gated_norm(self) -> bool:
        """Whether :meth:`forward_gated_norm` applies (one weight, no per-part split)."""
        return self.part_spans is None

    def forward_gated_norm(
        self, o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``forward(gated_rms_norm(o, z, norm_weight, eps).flatten(-2))`` through
        ``kernels.gated_norm_fp8_linear`` (the GDN output norm folded into this linear: one launch at
        decode sizes). ``o`` / ``z``: ``[T, Hv, Dv]`` with ``Hv * Dv = in_features``; needs
        :attr:`takes_gated_norm`."""
        if self.part_spans is not None:
            raise ValueError("Fp8Linear.forward_gated_norm: a weight split into parts is not supported")
        y = self.kernels.gated_norm_fp8_linear(
            o,
            z,
            norm_weight,
            eps,
            self.weight,
            self.weight_scale_inv,
            self.block,
            local_bias(self.bias, self.shard),
            tickets=self.tickets,
        )
        return finish(y, self.shard)

    def extra_repr(self) -> str:
        s = (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fp8 block={list(self.block)}"
        )
        if self.shard is not None and self.shard.is_sharded:
            s += f", {self.shard.kind}-parallel {list(self.shard.ranges)} of {list(self.shard.parts)}"
        return s


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (``x_hat * (1 + weight)``) through ``kernels.rms_norm``.

    ``forward(x)`` -> ``y``; ``forward(x, residual)`` -> ``(rms_norm(x + residual), x + residual)``.
    """

    def __init__(self, hidden_size: int, eps: float, kernels, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernels.rms_norm(x, self.weight, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedMLP(nn.Module):
    """SwiGLU MLP with ``gate_proj`` and ``up_proj`` fused into ``gate_up_proj`` (rows ``[gate; up]``).

    Tensor parallel: ``gate_up_proj`` column-parallel (each rank holds its range of the gate rows and the
    same range of the up rows), ``down_proj`` row-parallel; ``reduce_results=False`` leaves the partial sum
    unreduced (the MoE block adds it to the routed experts' and reduces once).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        kernels,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext = SINGLE_PROCESS,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.kernels = kernels
        i = intermediate_size
        self.gate_up_proj = column_parallel_linear(hidden_size, 2 * i, parallel, parts=(i, i), dtype=dtype)
        self.down_proj = row_parallel_linear(
            i, hidden_size, parallel, reduce_results=reduce_results, dtype=dtype
        )
        self.intermediate_size = self.down_proj.in_features  # this rank's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))
