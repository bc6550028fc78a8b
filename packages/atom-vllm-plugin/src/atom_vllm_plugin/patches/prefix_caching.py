"""Serve ATOM's Qwen3-Next with prefix caching off, so vLLM's default configuration works (vLLM 0.32).

Why: vLLM enables prefix caching by default for hybrid models and then keeps the GDN state in the Mamba
"align" cache mode: one state block per ``block_size`` tokens, copied between blocks by vLLM's model runner
before each step. ATOM's GDN core keeps each request's conv and recurrent state, and the pending tokens of
deferred-commit verification, in one slot ("none" mode); it implements neither the per-block layout nor the
copies (on vLLM-CPU the copy kernel does not even exist, and the first request fails). Prefix caching is
therefore turned off, with a warning saying so, before vLLM derives the Mamba cache mode from it.

Extension point: vLLM's per-architecture config hooks (``VerifyAndUpdateConfig`` classes looked up in
``vllm.model_executor.models.config.MODELS_CONFIG_MAP`` by ``VllmConfig.try_verify_and_update_config``) are a
plain module dict with no registration API, and vLLM has no entry for ``Qwen3NextForCausalLM``; this patch
adds ours. It runs before vLLM's own hybrid-model hook, like vLLM's own encoder-only special case.
"""

from __future__ import annotations

import logging

from atom_vllm_plugin.config import TARGET_ARCH

logger = logging.getLogger("vllm.atom_vllm_plugin")

MESSAGE = (
    "ATOM's Qwen3-Next keeps each request's GDN state in one slot and does not support vLLM's prefix "
    "caching for hybrid models (Mamba cache mode 'align'); prefix caching is turned off. "
    "Pass --no-enable-prefix-caching (LLM(enable_prefix_caching=False)) to start without this warning."
)


def disable_prefix_caching(vllm_config) -> bool:
    """Turn prefix caching off in ``vllm_config``; return whether it was on."""
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        return False
    logger.warning(MESSAGE)
    cache.enable_prefix_caching = False
    return True


def apply() -> bool:
    """Register the config hook for the target architecture; return True (every platform needs it)."""
    from vllm.model_executor.models import config as model_configs

    existing = model_configs.MODELS_CONFIG_MAP.get(TARGET_ARCH)
    if existing is not None and getattr(existing, "atom_hook", False):
        return True
    if existing is not None:
        raise RuntimeError(
            f"vLLM now has its own config hook for {TARGET_ARCH} ({existing.__name__}); "
            "atom_vllm_plugin.patches.prefix_caching must be revisited for this vLLM version"
        )

    class AtomQwen3NextConfigHook(model_configs.VerifyAndUpdateConfig):
        atom_hook = True

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            disable_prefix_caching(vllm_config)

    model_configs.MODELS_CONFIG_MAP[TARGET_ARCH] = AtomQwen3NextConfigHook
    return True
