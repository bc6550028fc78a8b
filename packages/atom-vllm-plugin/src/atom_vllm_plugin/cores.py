"""The CoreFactory the plugin gives atom-models: cores bound to vLLM's KV cache and Mamba state."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig
from atom_models.parallel import TPLayout
from torch import nn

from atom_vllm_plugin.config import AtomVllmConfig
from atom_vllm_plugin.layers.attention import AtomAttentionCore, register_layer
from atom_vllm_plugin.layers.gdn import AtomGDNCore
from atom_vllm_plugin.layers.gdn_snapshots import SnapshotSchedule
from atom_vllm_plugin.layers.gdn_state import GDNStateSpec


class VllmCoreFactory:
    """Builds one vLLM layer per token mixer, registered in vLLM's forward context under its prefix.

    ``prefix`` comes from atom-models (``model.layers.{i}.self_attn``, ``model.layers.{i}.linear_attn``,
    ``mtp.layers.{num_hidden_layers + j}.self_attn``), so every layer name carries its absolute index:
    vLLM binds caches by that index and the draft's layer can never share a target layer's cache.

    Sizes are one tensor-parallel rank's (``layout``, from atom-models): an attention core holds this
    rank's query and KV heads, so vLLM's KV cache spec (and the cache it allocates) is per rank; a GDN core
    takes the per-rank state spec the model class reported to vLLM, checked against ``layout`` here.
    """

    def __init__(
        self, cfg: AtomVllmConfig, kernels, gdn_state: GDNStateSpec | None, device: torch.device | None = None
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.kernels = kernels
        self.gdn_state = gdn_state
        self.built: dict[str, nn.Module] = {}
        self.snapshot_schedule = SnapshotSchedule()  # prefix caching: this model's GDN copies per step

    def attention(self, prefix: str, layer_idx: int, config: Qwen3NextConfig, layout: TPLayout) -> nn.Module:
        core = AtomAttentionCore(
            prefix,
            num_heads=layout.num_heads,
            num_kv_heads=layout.num_kv_heads,
            head_size=config.head_dim,
            kernels=self.kernels,
            dtype=self.cfg.dtype,
            is_draft=self.cfg.role == "draft",
            device=self.device,
        )
        register_layer(prefix, core)
        self.built[prefix] = core
        return core

    def gdn(self, prefix: str, layer_idx: int, config: Qwen3NextConfig, layout: TPLayout) -> nn.Module:
        if self.gdn_state is None:
            raise ValueError(
                f"{prefix}: the {self.cfg.role} model has no GDN state spec (the MTP draft has no GDN)"
            )
        self.gdn_state.geometry.check_layout(layout, f"{prefix}: the GDN state reported to vLLM")
        core = AtomGDNCore(prefix, self.gdn_state, self.kernels, self.snapshot_schedule)
        register_layer(prefix, core)
        self.built[prefix] = core
        return core
