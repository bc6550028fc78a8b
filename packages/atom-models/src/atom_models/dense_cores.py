"""A cache-less core factory for parity tests: attention over each whole sequence, GDN from a zero state.

``ctx`` is a :class:`DenseContext` (the lengths of the sequences packed in the flat batch) or ``None``
(one sequence). All the math goes through ``atom_kernels`` (the same ops as the engine's cores): attention
writes K/V into a scratch paged cache built for the call and runs ``paged_attention`` over it; nothing is
kept between forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig
from torch import nn

from atom_models.gdn_meta import GDNPrefillMeta, GDNWeights
from atom_models.gdn_pipeline import gdn_prefill
from atom_models.gdn_state import GDNGeometry, GDNLayerState
from atom_models.parallel import TPLayout


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


class DenseAttentionCore(nn.Module):
    """Causal softmax attention within each sequence: ``kernels.kv_cache_write`` into a scratch paged cache
    sized for this call (each sequence in its own run of blocks), then ``kernels.paged_attention``."""

    def __init__(self, config: Qwen3NextConfig, kernels, block_size: int = 16):
        super().__init__()
        self.kernels = kernels
        self.scale = config.head_dim**-0.5
        self.block_size = block_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx) -> torch.Tensor:
        lens = _seq_lens(ctx, q.shape[0])
        bs, dev = self.block_size, q.device
        nblocks = [-(-n // bs) for n in lens]
        first = [0]
        for nb in nblocks[:-1]:
            first.append(first[-1] + nb)
        tables = torch.zeros(len(lens), max(nblocks), dtype=torch.int32)
        for i, (b0, nb) in enumerate(zip(first, nblocks)):
            tables[i, :nb] = torch.arange(b0, b0 + nb, dtype=torch.int32)
        slots = torch.cat([torch.arange(n) + b0 * bs for n, b0 in zip(lens, first)])
        key_cache = k.new_zeros(sum(nblocks), bs, *k.shape[1:])
        value_cache = v.new_zeros(sum(nblocks), bs, *v.shape[1:])
        self.kernels.kv_cache_write(k, v, key_cache, value_cache, slots.to(dev))
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        return self.kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            tables.to(dev),
            seq_lens,
            DenseContext(lens).cu_seqlens(dev),
            self.scale,
        )


class DenseGDNCore(nn.Module):
    """The GDN pipeline's prefill over each whole sequence, from a zero state made for the call (this
    tensor-parallel rank's heads when ``layout`` is given)."""

    def __init__(self, config: Qwen3NextConfig, kernels, layout: TPLayout | None = None):
        super().__init__()
        self.kernels = kernels
        self.geometry = GDNGeometry.from_config(config, layout=layout)

    def forward(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, weights: GDNWeights, ctx):
        lens = _seq_lens(ctx, mixed_qkv.shape[0])
        n, dev = len(lens), mixed_qkv.device
        state = GDNLayerState.allocate(
            self.geometry, n, conv_dtype=mixed_qkv.dtype, ssm_dtype=torch.float32, device=dev
        )
        meta = GDNPrefillMeta(
            num_seqs=n,
            num_tokens=mixed_qkv.shape[0],
            cu_seqlens=DenseContext(lens).cu_seqlens(dev),
            state_indices=torch.arange(n, dtype=torch.int32, device=dev),
            has_initial_state=torch.zeros(n, dtype=torch.bool, device=dev),
        )
        return gdn_prefill(self.kernels, self.geometry, weights, state, mixed_qkv, b, a, meta)


class DenseCoreFactory:
    """``CoreFactory`` for parity tests (no paging, no state carried between forwards)."""

    def __init__(self, kernels):
        self.kernels = kernels

    def attention(self, prefix: str, layer_idx: int, config: Qwen3NextConfig, layout: TPLayout) -> nn.Module:
        return DenseAttentionCore(config, self.kernels)

    def gdn(self, prefix: str, layer_idx: int, config: Qwen3NextConfig, layout: TPLayout) -> nn.Module:
        return DenseGDNCore(config, self.kernels, layout)
