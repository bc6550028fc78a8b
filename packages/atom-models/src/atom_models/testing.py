"""Builders for tests and benchmarks of atom-models and its adapters: a tiny one-layer Qwen3-Next config,
Gated DeltaNet layers with random weights, GDN states in vLLM's page layout, and the per-layer whole-slot
copy (the oracle of :class:`~atom_models.gdn_snapshot.SlotCopier` and the benchmarks' baseline). Shipped with the package so
that the tests of a package built on atom-models (the vLLM plugin) and the benchmarks build the same objects
as atom-models' own tests. Nothing here is used by the model code."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig

from atom_models.gdn import GatedDeltaNet
from atom_models.gdn_state import GDNGeometry, GDNLayerState

_TINY_CONFIG = {
    "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 1,
    "layer_types": ["linear_attention"], "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "intermediate_size": 64, "max_position_embeddings": 128, "vocab_size": 64,
}  # fmt: skip


def tiny_config(**overrides) -> Qwen3NextConfig:
    """One layer, a tiny Gated DeltaNet: hidden 32, 2 key heads of 16, 4 value heads of 8, conv kernel 4
    (``pending_width(2, 16, 4, 8)``). ``overrides`` are HF ``config.json`` fields that replace or add to
    these (e.g. ``num_experts`` / ``num_experts_per_tok`` / ``moe_intermediate_size`` for a MoE block)."""
    return Qwen3NextConfig.from_hf({**_TINY_CONFIG, **overrides})


def normal_parameters_(module: torch.nn.Module, std: float) -> torch.nn.Module:
    """Every parameter of ``module`` drawn in place from N(0, std^2) with torch's global generator, in
    ``module.parameters()`` order; returns ``module``."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)
    return module


def random_gdn_layer(cfg: Qwen3NextConfig, kernels, dtype: torch.dtype = torch.float32) -> GatedDeltaNet:
    """Layer 0 of ``cfg`` without a core, every parameter drawn from N(0, 0.5^2) with torch's global
    generator; on the default device (build it inside ``with torch.device(...)`` for another)."""
    return normal_parameters_(GatedDeltaNet(cfg, 0, core=None, kernels=kernels, dtype=dtype), 0.5)


def paged_gdn_states(
    geo: GDNGeometry,
    layers: int,
    slots: int,
    *,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
    pad_bytes: int = 0,
) -> tuple[list[GDNLayerState], list[torch.Tensor]]:
    """``layers`` GDN layer states of ``slots`` slots each, laid out as vLLM lays out Mamba state, filled
    with random bytes. Returns ``(states, pools)``.

    Per layer one ``uint8`` pool of ``slots`` pages; a page holds one slot's conv (bf16, stored ``[W, C]``,
    the state's ``conv`` the transposed ``[S, C, W]`` view), ssm (float32), and with speculative decoding
    pending (float32) and pending_pos (int32), each tensor a page-strided view of the pool. A page is its
    tensors' bytes rounded up to 64, plus ``pad_bytes``. Every byte is below 64, so every bf16 / float32 the
    views read is finite (rows compare with ``torch.equal``). ``generator`` (on ``device``) draws the bytes;
    None: torch's global generator of ``device``."""
    shapes = [(geo.conv_width, geo.conv_dim), geo.ssm_shape, geo.pending_shape, geo.pending_pos_shape]
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.int32]
    if not geo.has_pending:
        shapes, dtypes = shapes[:2], dtypes[:2]
    sizes = [torch.Size(s).numel() * dt.itemsize for s, dt in zip(shapes, dtypes)]
    page = sum(sizes) + (-sum(sizes) % 64) + pad_bytes
    states, pools = [], []
    for _ in range(layers):
        pool = torch.randint(0, 64, (slots * page,), generator=generator, dtype=torch.uint8, device=device)
        views, off = [], 0
        for shape, dt, size in zip(shapes, dtypes, sizes):
            inner = torch.empty(shape, device="meta").stride()
            es = dt.itemsize
            views.append(torch.as_strided(pool.view(dt), (slots, *shape), (page // es, *inner), off // es))
            off += size
        views[0] = views[0].transpose(1, 2)
        states.append(GDNLayerState(*views))
        pools.append(pool)
    return states, pools


def copy_slots(state: GDNLayerState, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``state[dst[i]] = state[src[i]]`` for every state tensor (conv, ssm, pending, pending_pos) of one
    layer, one ``index_select`` and one ``index_copy_`` per tensor.

    ``src`` / ``dst``: ``[n]`` int64 slot indices, no destination repeated and none also a source (the
    sources are read in full before any destination is written); ``n == 0`` does nothing."""
    if src.numel() == 0:
        return
    for t in state.tensors():
        t.index_copy_(0, dst, t.index_select(0, src))
