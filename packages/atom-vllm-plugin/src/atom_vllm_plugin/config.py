"""Translate vLLM's ``VllmConfig`` into atom-core configs, separately for the target and the MTP draft.

This is the only place that knows how vLLM describes the draft: for ``method: mtp`` vLLM rewrites the
draft's HF config to ``model_type: qwen3_next_mtp`` / ``architectures: ["Qwen3NextMTP"]`` and builds it
under the compilation model tag ``eagle_head``. Each model wrapper translates its own config once, at
construction, and hands it down explicitly; nothing below the plugin ever sees vLLM's objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from atom_core import MAX_SPECULATIVE_TOKENS, CacheConfig, ConfigError, Qwen3NextConfig, SpeculativeConfig
from atom_models.parallel import TPLayout

TARGET_ARCH = "Qwen3NextForCausalLM"
DRAFT_ARCH = "Qwen3NextMTP"
DRAFT_MODEL_TAG = "eagle_head"

Role = Literal["target", "draft"]


@dataclass(frozen=True)
class AtomVllmConfig:
    """Everything one of our models needs from vLLM, as atom-core values."""

    role: Role
    model: Qwen3NextConfig
    speculative: SpeculativeConfig | None
    dtype: torch.dtype
    tensor_parallel_size: int = 1  # vLLM's parallel_config.tensor_parallel_size, checked against the model
    # vLLM's parallel_config.enable_expert_parallel: the routed experts partitioned over the TP ranks (whole,
    # 1/tp of them loaded per rank) instead of split over their intermediate dimension (atom_models TPLayout)
    expert_parallel: bool = False

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    # transformers 5 keeps the rope settings in `rope_parameters`; older versions in rope_theta/rope_scaling.
    if "rope_parameters" not in raw and getattr(hf_config, "rope_parameters", None) is not None:
        raw["rope_parameters"] = dict(hf_config.rope_parameters)
    return raw


def speculative_from_vllm(spec: Any) -> SpeculativeConfig | None:
    """vLLM's SpeculativeConfig -> atom-core's, or None without speculative decoding."""
    if spec is None:
        return None
    method = getattr(spec, "method", None)
    if method != "mtp":
        raise ConfigError(
            "method",
            method,
            "speculative_config",
            "the ATOM plugin serves Qwen3-Next drafts with method 'mtp' only",
        )
    k = spec.num_speculative_tokens
    if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(
            "num_speculative_tokens",
            k,
            "speculative_config",
            f"must be in [1, {MAX_SPECULATIVE_TOKENS}] for Qwen3-Next MTP with the ATOM plugin",
        )
    return SpeculativeConfig(method="mtp", num_speculative_tokens=int(k))


PLUGIN_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def cache_from_vllm(cache_config: Any) -> CacheConfig:
    """vLLM's cache config -> ours. KV cache dtypes: ``auto`` (model dtype) and ``fp8`` / ``fp8_e4m3`` (e4m3
    with per-tensor k/v scales, see :class:`~atom_vllm_plugin.layers.attention.AtomAttentionCore`)."""
    dtype = str(cache_config.cache_dtype)
    if dtype not in PLUGIN_KV_CACHE_DTYPES:
        raise ConfigError(
            "kv_cache_dtype",
            dtype,
            "cache_config",
            f"the ATOM plugin's attention stores the KV cache as one of {list(PLUGIN_KV_CACHE_DTYPES)}",
        )
    return CacheConfig(block_size=int(cache_config.block_size), kv_cache_dtype=dtype)


def check_quantization(method: str | None, model: Qwen3NextConfig, where: str) -> None:
    """Refuse a ``--quantization`` the plugin would not apply.

    vLLM sets ``model_config.quantization`` from the checkpoint's ``quantization_config`` (``fp8`` for the
    published FP8 checkpoints, which the plugin serves with its block-FP8 kernels) or from the user's
    ``--quantization`` flag. On a checkpoint without ``quantization_config`` the flag asks for vLLM's online
    quantisation of the loaded weights, which the plugin's models (built from atom-models, not from vLLM's
    quantisable layers) do not do: refused here rather than served unquantised.
    """
    if method is None:
        return
    if model.quantization is None:
        raise ConfigError(
            "quantization",
            method,
            "vllm_config (--quantization)",
            f"{where} has no quantization_config: the ATOM plugin serves FP8 only from FP8 checkpoints "
            "(e4m3, 128x128 block scales; packages/atom-models/scripts/make_fp8_checkpoint.py makes one from a "
            "bf16 checkpoint) and does not quantise weights online; leave --quantization unset",
        )
    if method != "fp8":
        raise ConfigError(
            "quantization",
            method,
            "vllm_config (--quantization)",
            f"{where} is an FP8 block-quantised checkpoint; the ATOM plugin serves it as 'fp8' only",
        )


def model_tag() -> str | None:
    """The compilation model tag vLLM sets while it builds a model (``eagle_head`` for drafts)."""
    from vllm.compilation.backends import model_tag as tag

    return tag


def from_vllm(vllm_config: Any, role: Role) -> AtomVllmConfig:
    """Build the config of the target (``role='target'``) or of the MTP draft (``role='draft'``).

    Refuses a ``tensor_parallel_size`` the model cannot be sharded by (a :class:`ConfigError` naming the
    config field, e.g. ``linear_num_key_heads``, or ``num_experts`` with ``enable_expert_parallel``): every
    worker's model constructor and the GDN state-size classmethods start here, so such a size fails before
    any weight is read. ``enable_expert_parallel`` partitions the routed experts over the TP ranks; with
    ``data_parallel_size > 1`` it is refused (vLLM's expert group would span the DP replicas)."""
    spec = speculative_from_vllm(vllm_config.speculative_config)
    if role == "draft":
        if spec is None or vllm_config.speculative_config.draft_model_config is None:
            raise ConfigError(
                "speculative_config", None, "vllm_config", f"{DRAFT_ARCH} is a draft: it needs method 'mtp'"
            )
        hf = vllm_config.speculative_config.draft_model_config.hf_config
        where = vllm_config.speculative_config.draft_model_config.model
    else:
        hf = vllm_config.model_config.hf_text_config
        where = vllm_config.model_config.model
    model = Qwen3NextConfig.from_hf(_hf_dict(hf), source=f"{where} (config.json as vLLM read it)")
    if role == "draft" and model.num_mtp_layers < 1:
        raise ConfigError(
            "mtp_num_hidden_layers",
            0,
            "draft hf_config",
            "the checkpoint has no MTP head; use it without method 'mtp'",
        )
    cache_from_vllm(vllm_config.cache_config)  # rejects a KV cache dtype the plugin cannot store
    if role == "target":  # the target is built first: a refused flag stops vLLM before any weight is read
        check_quantization(getattr(vllm_config.model_config, "quantization", None), model, where)
    ep = bool(getattr(vllm_config.parallel_config, "enable_expert_parallel", False))
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
    if ep and dp > 1:  # vLLM's expert group would span the DP replicas; the plugin partitions over TP only
        raise ConfigError(
            "data_parallel_size",
            dp,
            "vllm_config",
            "the ATOM plugin partitions experts over the tensor-parallel ranks only; expert parallel with "
            "data_parallel_size > 1 is not supported (use data parallel without expert parallel, or TP + EP)",
        )
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    # ConfigError naming the field the TP size does not divide (num_experts with expert parallel)
    TPLayout.from_config(model, 0, tp, expert_parallel=ep)
    return AtomVllmConfig(
        role=role,
        model=model,
        speculative=spec,
        dtype=vllm_config.model_config.dtype,
        tensor_parallel_size=tp,
        expert_parallel=ep,
    )
