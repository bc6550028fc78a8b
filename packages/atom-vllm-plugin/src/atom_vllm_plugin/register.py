"""The ``vllm.general_plugins`` entry point: put ATOM's Qwen3-Next and its MTP draft into vLLM's registry.

vLLM calls :func:`register` once per process (engine core, every worker, the API server), possibly more
than once; it is idempotent. It also adds the target's entry to vLLM's per-architecture config hooks
(:mod:`atom_vllm_plugin.config_hook`: a finer ``prefix_match_unit`` by default, and a log line naming the GPU
model runner, :mod:`atom_vllm_plugin.model_runner`). With ``ATOM_DISABLE_VLLM_PLUGIN=1`` it does none of this
and stock vLLM models run.
"""

from __future__ import annotations

import logging
import threading

from atom_core import envs

from atom_vllm_plugin.config import DRAFT_ARCH, TARGET_ARCH

# A child of the "vllm" logger, so the line appears in vLLM's own log output.
logger = logging.getLogger("vllm.atom_vllm_plugin")


def _model_classes() -> dict[str, type]:
    # Registered as classes, not "module:Class" strings: vLLM inspects string-registered models in a
    # subprocess that imports vLLM again (about a minute per architecture on a busy 2-core machine).
    from atom_vllm_plugin.models.draft import AtomQwen3NextMTP
    from atom_vllm_plugin.models.target import AtomQwen3NextForCausalLM

    return {TARGET_ARCH: AtomQwen3NextForCausalLM, DRAFT_ARCH: AtomQwen3NextMTP}


_lock = threading.Lock()
_registered = False


def register() -> bool:
    """Register ATOM's model classes with vLLM's ModelRegistry. Returns whether ATOM is active."""
    global _registered
    if envs.plugin_disabled():
        logger.info("ATOM vLLM plugin disabled (ATOM_DISABLE_VLLM_PLUGIN=1): stock vLLM Qwen3-Next is active")
        return False
    with _lock:
        if _registered:
            return True
        from vllm import ModelRegistry

        from atom_vllm_plugin import config_hook
        from atom_vllm_plugin.patches import apply_patches

        apply_patches()
        config_hook.install()
        for arch, cls in _model_classes().items():
            ModelRegistry.register_model(arch, cls)
        _registered = True
    logger.info(
        "ATOM vLLM plugin active: %s and %s run atom-models with atom-kernels",
        TARGET_ARCH,
        DRAFT_ARCH,
    )
    return True
