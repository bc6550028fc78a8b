"""Pieces both model wrappers share: kernel selection, GDN state spec from vLLM's config, checkpoint dir."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
from atom_kernels import select_kernels
from atom_models.parallel import TPLayout
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, is_conv_state_dim_first

from atom_vllm_plugin.config import AtomVllmConfig, from_vllm
from atom_vllm_plugin.layers.custom_ops import SPLITTING_OPS, compilable_kernels
from atom_vllm_plugin.layers.gdn_state import GDNStateSpec

logger = logging.getLogger("vllm.atom_vllm_plugin")


# vLLM's support_torch_compile: the token dimension of every per-token input is dynamic (positions: its
# last dim, as in vLLM's own models, where M-RoPE positions are [3, T]).
TARGET_DYNAMIC_ARG_DIMS = {"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
DRAFT_DYNAMIC_ARG_DIMS = {**TARGET_DYNAMIC_ARG_DIMS, "hidden_states": 0}


def add_splitting_ops(vllm_config: Any) -> list[str]:
    """Make the plugin's layer ops split vLLM's compiled graph wherever vLLM splits at its own attention.

    vLLM resolves ``compilation_config.splitting_ops`` in ``VllmConfig.__post_init__``
    (``set_splitting_ops_for_v1``: ``None`` -> its ``_attention_ops``, plus the KV-cache update ops) and reads
    it when its compile backend is created, which ``support_torch_compile`` does right after the model's
    ``__init__``. Appending ours here, from the model constructor, needs no hook into vLLM's config code and
    keeps vLLM's resolution as it is: the ops are added only where vLLM split at its attention ops (mode
    VLLM_COMPILE with piecewise splitting); an empty list (one full graph, or fused attention) is left alone.
    Returns the ops added.
    """
    cc = vllm_config.compilation_config
    ops = cc.splitting_ops
    if not ops or not cc.splitting_ops_contain_attention():
        return []
    added = [op for op in SPLITTING_OPS if op not in ops]
    ops.extend(added)
    return added


def log_compilation(what: str, vllm_config: Any) -> None:
    """Say in vLLM's log whether vLLM's torch.compile compiles this model, and how."""
    add_splitting_ops(vllm_config)
    cc = vllm_config.compilation_config
    mode = getattr(cc, "mode", None)
    if mode is None or int(mode) in (0, 1):  # NONE, STOCK_TORCH_COMPILE (compiled by the runner, if at all)
        logger.info("%s runs eagerly (vLLM compilation mode %s)", what, mode)
        return
    split = [op for op in SPLITTING_OPS if op in (cc.splitting_ops or [])]
    logger.info(
        "%s is compiled by vLLM's torch.compile (mode %s, backend %r); its attention and GDN layers are "
        "opaque custom ops%s",
        what,
        getattr(mode, "name", mode),
        cc.backend or "inductor",
        f" splitting the graph ({', '.join(split)})" if split else " inside one graph (no splitting ops)",
    )


def kernels_for(vllm_config: Any, dtype: torch.dtype):
    """The kernels for vLLM's device, the FP8 linears, the routed experts and (where Triton binds them)
    ``linear`` and ``moe_gate_router`` behind opaque ops that vLLM's torch.compile leaves uncompiled (see
    :mod:`atom_vllm_plugin.layers.custom_ops`)."""
    kernels = select_kernels(device=torch.device(vllm_config.device_config.device), dtype=dtype)
    return compilable_kernels(kernels)


def model_device(vllm_config: Any) -> torch.device:
    """Where vLLM runs the model (``device_config.device``): the models are allocated there, once."""
    return torch.device(vllm_config.device_config.device)


def ssm_cache_dtype(vllm_config: Any) -> str:
    """vLLM's ``mamba_ssm_cache_dtype`` for the target's GDN states, with ``auto`` read as ``float32`` on a
    CPU: the CPU GDN passes (``atom_kernels.ops.gated_delta_rule.cpu_native*``) keep float32 states, a
    bf16 pool takes the torch forms. vLLM resets ``auto`` to float32 itself on CPUs with AVX512-BF16 or
    AMX (``platforms/cpu.py``), not on others (an AVX2 EPYC), where the model dtype would follow; float32
    on every CPU also matches atom-models' engine. An explicit choice is kept; on GPUs ``auto`` stays
    vLLM's (the conv state's dtype)."""
    choice = vllm_config.cache_config.mamba_ssm_cache_dtype
    if choice == "auto" and model_device(vllm_config).type == "cpu":
        return "float32"
    return choice


def gdn_state_spec(vllm_config: Any, cfg: AtomVllmConfig | None = None) -> GDNStateSpec:
    """The state of one target GDN layer on one TP rank (every rank holds equal sizes): vLLM asks for it
    through the model class before the model exists, and the model's GDN cores get the same spec."""
    cfg = cfg or from_vllm(vllm_config, "target")
    conv_dtype, ssm_dtype = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        vllm_config.model_config.dtype,
        vllm_config.cache_config.mamba_cache_dtype,
        ssm_cache_dtype(vllm_config),
    )
    return GDNStateSpec.from_config(
        cfg.model,
        cfg.num_speculative_tokens,
        conv_dtype,
        ssm_dtype,
        conv_dim_first=is_conv_state_dim_first(),
        layout=TPLayout.from_config(cfg.model, 0, cfg.tensor_parallel_size),
    )


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of memory ``module``'s parameters hold (a storage shared by several counted once; a packed
    linear's released weight, a one-element stand-in, counts as what it holds)."""
    storages = {}
    for p in module.parameters():
        st = p.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def log_rank_memory(what: str, layout: Any, module: torch.nn.Module, cores: Any, vllm_config: Any) -> str:
    """Log (and return) what this TP rank holds: parameter bytes, GDN state bytes per slot and KV cache
    bytes per token, per layer, as reported to vLLM (vLLM pads a GDN page up to the attention block page)."""
    from atom_vllm_plugin.layers.attention import AtomAttentionCore
    from atom_vllm_plugin.layers.gdn import AtomGDNCore

    attn = [c for c in cores.built.values() if isinstance(c, AtomAttentionCore)]
    gdn = [c for c in cores.built.values() if isinstance(c, AtomGDNCore)]
    parts = [f"parameters {parameter_bytes(module)} bytes"]
    if gdn:
        parts.append(f"GDN state {gdn[0].state.bytes_per_slot} bytes per slot x {len(gdn)} layers")
    if attn:
        spec = attn[0].get_kv_cache_spec(vllm_config)
        parts.append(
            f"KV cache {spec.page_size_bytes // spec.block_size} bytes per token x {len(attn)} layers "
            f"({attn[0].num_heads} query / {attn[0].num_kv_heads} KV heads)"
        )
    line = f"{what} on TP rank {layout.rank} of {layout.world_size}: " + ", ".join(parts)
    logger.info("%s", line)
    return line


def checkpoint_dir(model_config: Any) -> str:
    """Local directory of the checkpoint vLLM serves (resolving a hub id through vLLM's own download)."""
    path = model_config.model
    if os.path.isdir(path):
        return path
    from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

    return download_weights_from_hf(
        path, cache_dir=None, allow_patterns=["*.safetensors", "*.json"], revision=model_config.revision
    )


def start_vllm_load_clock(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Advance vLLM's lazy weight iterator by one tensor (one small read) and leave the rest unread.

    atom-models reads the checkpoint itself, but vLLM 0.32's DefaultModelLoader starts its "Loading weights
    took ... seconds" clock only when that iterator is first advanced; left untouched, it logged the
    process uptime instead (e.g. 6006 s for a 20 s load).
    """
    next(iter(weights), None)


def all_parameter_names(module: torch.nn.Module) -> set[str]:
    """What vLLM's loader checks the returned "loaded" set against."""
    return {name for name, _ in module.named_parameters()}
