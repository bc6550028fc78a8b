"""Small building blocks shared by the Qwen3-Next target and the MTP draft.

Weights are allocated with ``torch.empty`` (no random init: every parameter comes from the checkpoint and
the loader checks that every one was written). Numeric ops come from the injected ``Kernels``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)``; ``weight`` is ``[out_features, in_features]`` as in HF checkpoints."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Fp8Linear(nn.Module):
    """``y = kernels.fp8_linear(x, weight, weight_scale_inv, block, bias)``: a W8A8 block-scaled linear.

    ``weight`` is ``[out_features, in_features]`` float8_e4m3fn and ``weight_scale_inv`` its float32
    ``[ceil(out/bn), ceil(in/bk)]`` block multipliers (the checkpoint's names); activations are quantised
    per token and group of ``bk`` channels inside the op. ``bias`` (optional) is in ``dtype``.
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
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = (int(block[0]), int(block[1]))
        self.kernels = kernels
        rows, cols = -(-out_features // self.block[0]), -(-in_features // self.block[1])
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fp8 block={list(self.block)}"
        )


class Embedding(nn.Module):
    """Token embedding table ``weight[V, H]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


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
    """SwiGLU MLP with ``gate_proj`` and ``up_proj`` fused into ``gate_up_proj`` (rows ``[gate; up]``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels, dtype: torch.dtype | None = None):
        super().__init__()
        self.kernels = kernels
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))
