"""Gated DeltaNet token mixer of Qwen3-Next (HF ``Qwen3NextGatedDeltaNet``); conv + recurrence live in a core
(which runs ``atom_models.gdn_pipeline`` over its own state)."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig
from torch import nn

from atom_models.gdn_meta import GDNWeights
from atom_models.gdn_state import GDNGeometry
from atom_models.modules import Fp8Linear, column_parallel_linear, row_parallel_linear
from atom_models.parallel import SINGLE_PROCESS, ParallelContext, TPLayout


class DepthwiseConv1dWeights(nn.Module):
    """The weights of HF's depthwise ``conv1d`` (``weight[C, 1, K]``, no bias); the core runs the conv."""

    def __init__(self, channels: int, kernel_size: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=dtype), requires_grad=False)
        self.bias = None


class GatedRMSNormWeights(nn.Module):
    """Weight of the GDN output norm ``weight * rms(x) * silu(z)`` (NOT zero-centred)."""

    def __init__(self, dim: int, eps: float, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)


class GatedDeltaNet(nn.Module):
    """in_proj -> (core: conv1d, gating, L2 norm, gated delta rule with state) -> gated RMSNorm(z) -> out_proj.

    Checkpoint layout: ``in_proj_qkvz`` rows are grouped per key head g,
    ``[q_g (Dk) | k_g (Dk) | v_g (r*Dv) | z_g (r*Dv)]`` with ``r = Hv / Hk``, and ``in_proj_ba`` rows are
    ``[b_g (r) | a_g (r)]`` per key head (HF ``fix_query_key_value_ordering``). Stored layout: the loader
    regroups the rows part-major (``weight_map`` rules with ``regroup``), ``in_proj_qkvz`` as
    ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv) | z (Hv*Dv)]`` and ``in_proj_ba`` as ``[b (Hv) | a (Hv)]``, so the
    projection outputs split into views (row-strided, unit last stride), no copy: the core receives the
    pre-conv ``mixed_qkv = y[:, :conv_dim]`` (``[q | k | v]``), ``b`` and ``a`` as ``[T, Hv]`` views of the
    ``in_proj_ba`` output, the :class:`GDNWeights` it needs (:meth:`gdn_weights`) and ``ctx``; it returns
    ``o[T, Hv, Dv]``; the norm's gate is ``z = y[:, conv_dim:]`` viewed ``[T, Hv, Dv]``. An FP8
    ``out_proj`` (:class:`~atom_models.modules.Fp8Linear`) takes the norm too
    (``kernels.gated_norm_fp8_linear``: one launch at decode sizes); a bf16 one follows the norm.

    Tensor parallel (``layout``): a rank holds ``Hk / tp`` key-head groups with their value heads. The
    per-group checkpoint layout makes its rows of ``in_proj_qkvz`` and ``in_proj_ba`` one contiguous range
    each (column-parallel), regrouped part-major on the rank after reading; ``conv1d`` holds its q, k and v
    channels (three ranges of the checkpoint's), ``A_log`` / ``dt_bias`` its value heads; the norm weight
    (per channel of one head) is replicated and ``out_proj`` is row-parallel (its all-reduce is the block's
    one collective). Head counts and dims below are this rank's; the core gets this rank's ``mixed_qkv`` /
    ``b`` / ``a``.
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
        geo = GDNGeometry.from_config(config, layout=layout)
        self.kernels = kernels
        self.layer_idx = layer_idx
        self.num_k_heads = geo.num_k_heads
        self.num_v_heads = geo.num_v_heads
        self.head_k_dim = geo.head_k_dim
        self.head_v_dim = geo.head_v_dim
        self.key_dim = geo.key_dim
        self.value_dim = geo.value_dim
        self.conv_dim = geo.conv_dim
        self.conv_kernel_size = geo.conv_kernel
        self.heads_per_group = self.num_v_heads // self.num_k_heads
        h = config.hidden_size
        self.in_proj_qkvz = column_parallel_linear(
            h, 2 * config.linear_key_dim + 2 * config.linear_value_dim, parallel, dtype=dtype
        )
        # 2 * Hv features (64 on the 80B model, fewer per TP rank): a decode step's tokens are too few for a
        # GEMM, so the product goes through kernels.linear (the triton backend: one GEMV launch)
        self.in_proj_ba = column_parallel_linear(
            h, 2 * config.linear_num_value_heads, parallel, dtype=dtype, kernels=kernels
        )
        self.conv1d = DepthwiseConv1dWeights(self.conv_dim, self.conv_kernel_size, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        # float32 whatever the model dtype (as stock vLLM keeps it): exp(A_log) scales every decay, and a
        # float32 checkpoint's A_log rounded to bf16 moves each head's decay rate by up to 0.4%
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNormWeights(self.head_v_dim, config.rms_norm_eps, dtype=dtype)
        self.out_proj = row_parallel_linear(config.linear_value_dim, h, parallel, dtype=dtype)
        self.core = core

    def split_projections(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """The stored (part-major) layout -> ``(mixed_qkv[T, C], z[T, Hv, Dv], b[T, Hv], a[T, Hv])``, all
        views of ``qkvz[T, C + Hv*Dv]`` / ``ba[T, 2*Hv]`` (row stride the projection's width, no copy)."""
        hv = self.num_v_heads
        z = qkvz[:, self.conv_dim :].unflatten(-1, (hv, self.head_v_dim))
        return qkvz[:, : self.conv_dim], z, ba[:, :hv], ba[:, hv:]

    def gdn_weights(self) -> GDNWeights:
        """The parameters the core's pipeline reads (conv weight as ``[C, K]``)."""
        return GDNWeights(
            conv_weight=self.conv1d.weight.view(self.conv_dim, self.conv_kernel_size),
            conv_bias=self.conv1d.bias,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx) -> torch.Tensor:
        t = hidden_states.shape[0]
        mixed_qkv, z, b, a = self.split_projections(
            self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        )
        o = self.core(mixed_qkv, b, a, self.gdn_weights(), ctx)
        if isinstance(self.out_proj, Fp8Linear) and self.out_proj.takes_gated_norm:
            return self.out_proj.forward_gated_norm(o, z, self.norm.weight, self.norm.eps)
        o = self.kernels.gated_rms_norm(o, z, self.norm.weight, self.norm.eps)
        return self.out_proj(o.reshape(t, self.value_dim))
