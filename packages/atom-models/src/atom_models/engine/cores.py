"""Cores of the standalone engine: paged attention and GDN with one state slot per sequence."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig
from torch import nn

from atom_models.engine.cache import EngineCaches
from atom_models.engine.context import StepContext


class PagedAttentionCore(nn.Module):
    def __init__(self, layer_idx: int, config: Qwen3NextConfig, caches: EngineCaches, kernels):
        super().__init__()
        self.layer_idx = layer_idx
        self.caches = caches
        self.kernels = kernels
        self.scale = config.head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        key_cache, value_cache = self.caches.kv[self.layer_idx]
        m = ctx.attn
        self.kernels.kv_cache_write(k, v, key_cache, value_cache, m.slot_mapping)
        return self.kernels.paged_attention(
            q, key_cache, value_cache, m.block_tables, m.seq_lens, m.query_start_loc, self.scale
        )


class SlotGDNCore(nn.Module):
    """Prefill tokens (first in the batch) go through the varlen conv + chunked rule, which writes the final
    state to the sequence's slot; plain decode groups through the conv update + recurrent rule (Q = 1, the
    slot updated in place); verify groups through the conv update (resuming at ``num_accepted``) +
    ``gated_delta_rule_verify`` (deferred commit into the slot, pending tokens in ``caches.pending``)."""

    def __init__(self, layer_idx: int, config: Qwen3NextConfig, caches: EngineCaches, kernels):
        super().__init__()
        self.layer_idx = layer_idx
        self.caches = caches
        self.kernels = kernels

    def forward(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer, ctx: StepContext):
        kern = self.kernels
        conv_state, ssm_state = self.caches.gdn[self.layer_idx]
        weight, bias = layer.conv1d.weight.squeeze(1), layer.conv1d.bias
        scale = layer.head_k_dim**-0.5
        g, beta = kern.gdn_gating(layer.A_log, a, layer.dt_bias, b)
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim)
        pre = ctx.gdn_prefill
        if pre is not None and pre.num_tokens:
            t = pre.num_tokens
            x = kern.causal_conv1d_varlen(
                mixed_qkv[:t],
                weight,
                bias,
                pre.cu_seqlens,
                conv_state,
                pre.state_indices,
                pre.has_initial_state,
                activation="silu",
            )
            q, k, v = layer.split_qkv(x)
            out[:t] = kern.gated_delta_rule_chunked(
                q,
                k,
                v,
                g[:t],
                beta[:t],
                pre.cu_seqlens,
                ssm_state,
                pre.state_indices,
                pre.has_initial_state,
                scale=scale,
                use_qk_l2norm=True,
            )
        for grp in ctx.gdn_decode:
            s, e = grp.start, grp.start + grp.num_seqs * grp.q_len
            n, ql = grp.num_seqs, grp.q_len
            x = kern.causal_conv1d_update(
                mixed_qkv[s:e].view(n, ql, -1),
                weight,
                bias,
                conv_state,
                grp.state_indices,
                grp.num_accepted,
                activation="silu",
            )
            q, k, v = layer.split_qkv(x)
            g_n, beta_n = g[s:e].view(n, ql, -1), beta[s:e].view(n, ql, -1)
            if grp.num_commit is None:
                o = kern.gated_delta_rule_recurrent(
                    q,
                    k,
                    v,
                    g_n,
                    beta_n,
                    ssm_state,
                    grp.state_indices.view(n, 1),
                    None,
                    scale=scale,
                    use_qk_l2norm=True,
                )
            else:
                o = kern.gated_delta_rule_verify(
                    q,
                    k,
                    v,
                    g_n,
                    beta_n,
                    ssm_state,
                    self.caches.pending[self.layer_idx],
                    grp.state_indices,
                    grp.num_commit,
                    scale=scale,
                    use_qk_l2norm=True,
                )
            out[s:e] = o.reshape(e - s, layer.num_v_heads, layer.head_v_dim)
        return out


class EngineCoreFactory:
    """``CoreFactory`` binding every layer to the engine's cache tensors."""

    def __init__(self, caches: EngineCaches, kernels):
        self.caches = caches
        self.kernels = kernels

    def attention(self, prefix: str, layer_idx: int, config: Qwen3NextConfig) -> nn.Module:
        if layer_idx not in self.caches.kv:
            raise KeyError(f"{prefix}: no KV cache allocated for attention layer {layer_idx}")
        return PagedAttentionCore(layer_idx, config, self.caches, self.kernels)

    def gdn(self, prefix: str, layer_idx: int, config: Qwen3NextConfig) -> nn.Module:
        if layer_idx not in self.caches.gdn:
            raise KeyError(f"{prefix}: no GDN state allocated for layer {layer_idx}")
        return SlotGDNCore(layer_idx, config, self.caches, self.kernels)
