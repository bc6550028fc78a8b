"""Full-attention core for vLLM: a vLLM attention layer over vLLM's paged KV cache, computed by atom_kernels.

atom-models' ``Qwen3NextAttention`` calls ``core(q, k, v, ctx)`` after q/k-norm and RoPE; this core
writes k/v into the layer's KV cache at vLLM's slot mapping and attends with ``paged_attention`` (causal
over each request's cached prefix and its new tokens, for any mix of prefill / decode / 1 + k verify).

``--kv-cache-dtype fp8``: the cache holds e4m3 ``k / k_scale`` and ``v / v_scale`` with per-tensor float32
scales kept, as on vLLM's own attention layers, in ``_k_scale`` / ``_v_scale`` (1.0: vLLM's default when
the checkpoint has no calibrated KV scales).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from atom_vllm_plugin.layers.attention_backend import (
    AtomAttentionBackend,
    AtomAttentionMetadata,
    split_kv_cache,
)
from atom_vllm_plugin.layers.custom_ops import register_ops
from atom_vllm_plugin.layers.forward_context import layer_metadata


def register_layer(prefix: str, layer: nn.Module) -> None:
    """Put ``layer`` into vLLM's static forward context under ``prefix`` (how vLLM finds cache-owning layers)."""
    ctx = get_current_vllm_config().compilation_config.static_forward_context
    if prefix in ctx:
        raise ValueError(f"Duplicate layer name: {prefix} (two layers would share one cache)")
    ctx[prefix] = layer


class AtomAttentionCore(nn.Module, AttentionLayerBase):
    """One full-attention layer's cache binding; ``forward(q[T, Hq, D], k, v, ctx) -> o[T, Hq, D]``."""

    def __init__(
        self,
        prefix: str,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        kernels,
        dtype: torch.dtype,
        is_draft: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        register_ops()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{prefix}: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        self.layer_name = prefix
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = head_size**-0.5
        self.kernels = kernels
        self.dtype = dtype
        self.is_draft_layer = is_draft
        self.kv_cache = torch.tensor([])
        # On ``device`` even while the model is built on the meta device (values, not allocations to fill)
        self.register_buffer("_k_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("_v_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)

    # ---- vLLM's AttentionLayerBase -----------------------------------------------------------
    def get_attn_backend(self) -> type[AtomAttentionBackend]:
        return AtomAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        cache_dtype = vllm_config.cache_config.cache_dtype
        dtype = self.dtype if cache_dtype == "auto" else kv_cache_dtype_str_to_dtype(cache_dtype, None)
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=dtype,
        )

    # ---- the core ----------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx=None) -> torch.Tensor:
        # Through the opaque op vllm::atom_attention_with_output (a splitting op of vLLM's compiled graph),
        # which calls run_into with this step's metadata.
        out = torch.empty_like(q)
        torch.ops.vllm.atom_attention_with_output(q, k, v, out, self.layer_name)
        return out

    def run_into(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The op's body: ``out`` = the core with this step's metadata."""
        self.run(layer_metadata(self.layer_name), q, k, v, out=out)

    def run(
        self,
        md: AtomAttentionMetadata | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The core for explicit metadata (``None``: profiling run, zeros out); ``out`` (like ``q``) receives
        the attention of the ``n`` real tokens and zeros in the padding rows after them."""
        if out is None:
            out = torch.empty_like(q)
        if md is None:  # profiling / dummy run: no cache bound yet
            return out.zero_()
        if not isinstance(md, AtomAttentionMetadata):
            raise TypeError(f"{self.layer_name}: expected AtomAttentionMetadata, got {type(md).__name__}")
        n = md.num_actual_tokens
        if n == 0:
            return out.zero_()
        key_cache, value_cache = split_kv_cache(self.kv_cache, self.head_size)
        scales = (self._k_scale, self._v_scale) if key_cache.dtype == torch.float8_e4m3fn else (None, None)
        self.kernels.kv_cache_write(k[:n], v[:n], key_cache, value_cache, md.slot_mapping[:n], *scales)
        # every row of q: the op zeroes the rows past query_start_loc[N] (vLLM's token padding) itself,
        # writing into ``out`` directly (no memset, no copy)
        return self.kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            self.scale,
            *scales,
            out=out,
        )

    def extra_repr(self) -> str:
        return f"{self.layer_name}, heads={self.num_heads}/{self.num_kv_heads}, head_size={self.head_size}"
