"""Gated full attention of Qwen3-Next (HF ``Qwen3NextAttention``); the cache-touching part is a core."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig
from torch import nn

from atom_models.modules import RMSNorm, column_parallel_linear, row_parallel_linear
from atom_models.parallel import SINGLE_PROCESS, ParallelContext, TPLayout


class Qwen3NextAttention(nn.Module):
    """Fused q/k/v projection, per-head q/k zero-centred RMSNorm, partial neox RoPE, ``core``, sigmoid
    output gate.

    ``qkv_proj`` is HF's ``q_proj``, ``k_proj`` and ``v_proj`` fused into one linear (one launch instead of
    three; vLLM's ``qkv_proj`` does the same): a deliberate exception to keeping HF attribute names, the
    checkpoint tensors are stacked into its rows on load (``weight_map.RULES``). Its rows are
    ``[q rows | k rows | v rows]`` of this rank, and its output splits into views: the q part viewed as
    ``[T, Hq, 2 * D]`` is ``[query_h | gate_h]`` for each head h (HF packs query and gate *per head*:
    ``torch.chunk(q_proj(x).view(..., Hq, 2D), 2, -1)``), then ``k`` and ``v`` as ``[T, Hkv, D]``.
    FP8 (:class:`~atom_models.modules.Fp8Linear`): each part keeps its own block-scale rows; when the q or k
    part is not a multiple of the block's rows, the fused layer multiplies part by part (exact, three
    launches again).

    Tensor parallel (``layout``): a head's q rows are contiguous, so the q part is column-parallel by query
    heads; the k / v parts hold this rank's KV heads (``layout.kv_head_start``; the same head on
    ``kv_head_replicas`` ranks when there are fewer KV heads than ranks); ``o_proj`` is row-parallel (its
    all-reduce is the block's one collective). The core sees this rank's heads only.
    """

    def __init__(
        self,
        config: Qwen3NextConfig,
        layer_idx: int,
        core: nn.Module,
        kernels,
        dtype=None,
        layout: TPLayout | None = None,
        parallel: ParallelContext = SINGLE_PROCESS,
    ):
        super().__init__()
        layout = TPLayout.of(config, parallel, layout)
        self.kernels = kernels
        self.layer_idx = layer_idx
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.rope_theta = config.rope_theta
        self.eps = config.rms_norm_eps
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        q_rows = (layout.rank * layout.num_heads * 2 * d, (layout.rank + 1) * layout.num_heads * 2 * d)
        kv_rows = (layout.kv_head_start * d, (layout.kv_head_start + layout.num_kv_heads) * d)
        parts = (hq * 2 * d, hkv * d, hkv * d)
        self.qkv_proj = column_parallel_linear(
            h, sum(parts), parallel, parts=parts, ranges=(q_rows, kv_rows, kv_rows), bias=bias, dtype=dtype
        )
        self.q_size = layout.num_heads * 2 * d  # this rank's output columns of each part
        self.kv_size = layout.num_kv_heads * d
        self.o_proj = row_parallel_linear(hq * d, h, parallel, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, kernels, dtype=dtype)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, kernels, dtype=dtype)
        self.core = core

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx) -> torch.Tensor:
        t = hidden_states.shape[0]
        d = self.head_dim
        qg, k, v = self.qkv_proj(hidden_states).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        qg = qg.view(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        q = self.q_norm(q)
        k = self.k_norm(k)
        q, k = self.kernels.rope(q, k, positions, self.rotary_dim, self.rope_theta)
        o = self.core(q, k, v, ctx)
        o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(t, self.num_heads * d))
