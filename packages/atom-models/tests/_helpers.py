"""Builders shared by this folder's tests: a one-layer Gated DeltaNet with random weights and its state,
and the fixture's float32 engine. ``conftest.py`` puts this folder on ``sys.path`` (pytest runs with
--import-mode=importlib, which does not), so tests import it as ``_helpers``."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig
from atom_models.engine import EngineConfig, LLMEngine
from atom_models.gdn import GatedDeltaNet
from atom_models.gdn_state import GDNGeometry, GDNLayerState

K_SPEC = 2  # speculative tokens the GDN layer tests size the verify and pending state for


def gdn_config() -> Qwen3NextConfig:
    """One layer, a tiny Gated DeltaNet: 2 key heads of 16, 4 value heads of 8, conv kernel 4."""
    raw = {
        "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "intermediate_size": 64, "max_position_embeddings": 128, "vocab_size": 64,
    }  # fmt: skip
    return Qwen3NextConfig.from_hf(raw)


def random_gdn_layer(cfg: Qwen3NextConfig, kernels, dtype: torch.dtype = torch.float32) -> GatedDeltaNet:
    """Layer 0 of ``cfg`` without a core, every parameter drawn from N(0, 0.5^2) with torch's global
    generator; on the default device (build it inside ``with torch.device(...)`` for another)."""
    layer = GatedDeltaNet(cfg, 0, core=None, kernels=kernels, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def gdn_state(
    geo: GDNGeometry, num_slots: int = 4, *, conv_dtype: torch.dtype = torch.float32, device="cpu"
) -> GDNLayerState:
    """Zeroed state of one GDN layer for ``num_slots`` sequences: conv state in ``conv_dtype``, recurrent
    state (and the pending pool, with speculative tokens) in float32."""
    return GDNLayerState.allocate(
        geo, num_slots, conv_dtype=conv_dtype, ssm_dtype=torch.float32, device=device
    )


def float32_engine(
    model_dir, k: int, graphs: bool | None = True, *, device: torch.device | str = "cpu", **kw
) -> LLMEngine:
    """The checkpoint in ``model_dir`` as a float32 engine on ``device`` with ``k`` speculative tokens and
    ``cuda_graphs=graphs`` (bucketed steps, run eagerly on a CPU); ``max_model_len`` 256 and
    ``max_num_seqs`` 8 unless ``kw`` sets them (or other ``EngineConfig`` fields)."""
    cfg = EngineConfig(
        num_speculative_tokens=k, cuda_graphs=graphs, **{"max_model_len": 256, "max_num_seqs": 8, **kw}
    )
    return LLMEngine.from_pretrained(model_dir, cfg, dtype=torch.float32, device=device)
