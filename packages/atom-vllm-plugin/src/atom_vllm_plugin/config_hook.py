"""vLLM's per-architecture config hook for the target: a finer ``prefix_match_unit`` by default, and a log
line naming the GPU model runner (:mod:`atom_vllm_plugin.model_runner`: vLLM's choice, both serve prefix
caching).

With prefix caching (vLLM's default) a hybrid model's KV-cache blocks are as large as one GDN state page
needs (256 tokens for the bundled float32 model, hundreds to thousands for Qwen3-Next): vLLM's default
``prefix_match_unit`` (the GCD of the group block sizes, i.e. the block size) lets a prefix hit land only
on a block boundary, and with an MTP drafter vLLM drops the last matched block, so a repeated prompt
recomputes up to two blocks. vLLM's ``prefix_match_unit`` is "the finest token boundary a hit can land on":
the scheduler then ends a prompt's last chunk at a unit boundary, the GDN snapshot of that boundary is kept
in the block it falls into (``layers.gdn_snapshots``), a hit inside a block copies the shared attention and
GDN block for the request (``patches.kv_block_copy``), and with MTP vLLM drops one unit instead of one
block. So the plugin sets :data:`FINE_PREFIX_MATCH_UNIT` tokens when prefix caching is on and the user left
the option unset (a user's ``--prefix-match-unit`` is kept).

vLLM raises when a KV-cache group's block size is not divisible by the unit. Every group block size of a
hybrid model in align mode is the attention block size that vLLM's platform picks after this hook
(``Platform._align_hybrid_block_size``): a whole multiple of ``cache_config.block_size`` as this hook sees it
(vLLM's default 16, vLLM-CPU's 128, set after this hook, or the user's ``--block-size``), rounded to whole
kernel blocks of the plugin's attention backend (any size). So the unit is set only where it divides that
block size; a ``--block-size`` that is not a multiple of it keeps vLLM's default.

Where: vLLM has no model-class hook for config defaults; ``VllmConfig.__post_init__`` consults
``vllm.model_executor.models.config.MODELS_CONFIG_MAP`` by architecture name, before it resolves the
platform's block sizes, in the process that builds the config (the engine core and the workers receive the
resolved config). :func:`install` adds the target architecture's entry there from ``register()``.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

from atom_vllm_plugin.config import TARGET_ARCH
from atom_vllm_plugin.model_runner import select_model_runner

logger = logging.getLogger("vllm.atom_vllm_plugin")

FINE_PREFIX_MATCH_UNIT = 16
"""Tokens per prefix-hash unit: vLLM's default block size for attention-only models. Hashing every 16
tokens instead of every block costs the engine core host time per prompt token (see docs/performance.md,
"Prefix caching on the CPU machines")."""


def default_prefix_match_unit(cache_config: Any) -> int | None:
    """The ``prefix_match_unit`` the plugin sets on ``cache_config``, or None to leave it as it is: prefix
    caching off, a unit the user chose, or a block size that the fine unit does not divide."""
    if not cache_config.enable_prefix_caching or cache_config.prefix_match_unit is not None:
        return None
    if cache_config.block_size % FINE_PREFIX_MATCH_UNIT:
        return None
    return FINE_PREFIX_MATCH_UNIT


def apply_prefix_match_unit(cache_config: Any) -> int | None:
    """Set :func:`default_prefix_match_unit` on ``cache_config`` (logged once at INFO); return it."""
    unit = default_prefix_match_unit(cache_config)
    if unit is not None:
        cache_config.prefix_match_unit = unit
        logger.info(
            "ATOM vLLM plugin: prefix caching on, prefix_match_unit=%d (prefix hits land on %d-token "
            "boundaries, not only on the hybrid model's KV-cache block boundaries); --prefix-match-unit N "
            "(LLM(prefix_match_unit=N)) chooses another",
            unit,
            unit,
        )
    return unit


class AtomQwen3NextConfig(VerifyAndUpdateConfig):
    """The plugin's defaults for vLLM's config of ``Qwen3NextForCausalLM``: the prefix-match unit, then
    the model runner's log line (which says whether prefix caching is on)."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        apply_prefix_match_unit(vllm_config.cache_config)
        select_model_runner(bool(vllm_config.cache_config.enable_prefix_caching))


def install() -> None:
    """Put :class:`AtomQwen3NextConfig` into vLLM's ``MODELS_CONFIG_MAP`` for the target (idempotent).

    Raises ``RuntimeError`` if vLLM has its own hook for the architecture: this module would replace it and
    must be revisited for that vLLM version."""
    current = MODELS_CONFIG_MAP.get(TARGET_ARCH)
    if current is not None and current is not AtomQwen3NextConfig:
        raise RuntimeError(
            f"vLLM has a config hook for {TARGET_ARCH} ({current.__name__}); atom_vllm_plugin.config_hook "
            "must be revisited for this vLLM version"
        )
    MODELS_CONFIG_MAP[TARGET_ARCH] = AtomQwen3NextConfig
