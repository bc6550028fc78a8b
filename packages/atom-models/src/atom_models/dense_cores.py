"""A cache-less core factory for parity tests: attention over each whole sequence, GDN from a zero state.

``ctx`` is a :class:`DenseContext` (the lengths of the sequences packed in the flat batch) or ``None``
(one sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from atom_core import Qwen3NextConfig
from torch import nn


@dataclass(frozen=True)
class DenseContext:
    seq_lens: tuple[int, ...]

    def cu_seqlens(self, device) -> torch.Tensor:
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return torch.tensor(out, dtype=torch.int32, device=device)


def _seq_lens(ctx: DenseContext | None, num_tokens: int) -> tuple[int, ...]:
    lens = (num_tokens,) if ctx is None else ctx.seq_lens
    if sum(lens) != num_tokens:
        raise ValueError(f"ctx.seq_lens {lens} sums to {sum(lens)}, but the batch has {num_tokens} tokens")
    return lens


def split_qkv(layer, x: torch.Tensor):
    """Post-conv ``x[..., C]`` -> ``q[..., Hk, Dk]``, ``k[..., Hk, Dk]``, ``v[..., Hv, Dv]``."""
    q, k, v = torch.split(x, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    lead = x.shape[:-1]
    return (
        q.reshape(*lead, layer.num_k_heads, layer.head_k_dim),
        k.reshape(*lead, layer.num_k_heads, layer.head_k_dim),
        v.reshape(*lead, layer.num_v_heads, layer.head_v_dim),
    )


class DenseAttentionCore(nn.Module):
    """Causal softmax attention within each sequence (no KV cache)."""

    def __init__(self, config: Qwen3NextConfig):
        super().__init__()
        self.scale = config.head_dim**-0.5
        self.groups = config.num_attention_heads // config.num_key_value_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx) -> torch.Tensor:
        outs, start = [], 0
        for n in _seq_lens(ctx, q.shape[0]):
            qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
            ks = ks.repeat_interleave(self.groups, dim=0)
            vs = vs.repeat_interleave(self.groups, dim=0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            outs.append(o.transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)


class DenseGDNCore(nn.Module):
    """conv1d + gated delta rule (chunked) over each whole sequence, starting from zero state."""

    def __init__(self, config: Qwen3NextConfig, kernels):
        super().__init__()
        self.kernels = kernels

    def forward(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer, ctx) -> torch.Tensor:
        kern = self.kernels
        lens = _seq_lens(ctx, mixed_qkv.shape[0])
        n, dev = len(lens), mixed_qkv.device
        cu = DenseContext(lens).cu_seqlens(dev)
        idx = torch.arange(n, dtype=torch.int32, device=dev)
        fresh = torch.zeros(n, dtype=torch.bool, device=dev)
        conv_state = torch.zeros(
            n, layer.conv_dim, layer.conv_kernel_size - 1, dtype=mixed_qkv.dtype, device=dev
        )
        x = kern.causal_conv1d_varlen(
            mixed_qkv,
            layer.conv1d.weight.squeeze(1),
            layer.conv1d.bias,
            cu,
            conv_state,
            idx,
            fresh,
            activation="silu",
        )
        q, k, v = split_qkv(layer, x)
        g, beta = kern.gdn_gating(layer.A_log, a, layer.dt_bias, b)
        ssm = torch.zeros(
            n, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim, dtype=torch.float32, device=dev
        )
        return kern.gated_delta_rule_chunked(
            q, k, v, g, beta, cu, ssm, idx, fresh, scale=layer.head_k_dim**-0.5, use_qk_l2norm=True
        )


class DenseCoreFactory:
    """``CoreFactory`` for parity tests (no paging, no state carried between forwards)."""

    def __init__(self, kernels):
        self.kernels = kernels

    def attention(self, prefix: str, layer_idx: int, config: Qwen3NextConfig) -> nn.Module:
        return DenseAttentionCore(config)

    def gdn(self, prefix: str, layer_idx: int, config: Qwen3NextConfig) -> nn.Module:
        return DenseGDNCore(config, self.kernels)
