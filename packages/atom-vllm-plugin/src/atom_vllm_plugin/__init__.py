"""ATOM's Qwen3-Next + MTP served by an unchanged vLLM 0.32 (plugin mode).

vLLM loads :func:`atom_vllm_plugin.register.register` through the ``vllm.general_plugins`` entry point.
"""

from atom_vllm_plugin._version_check import SUPPORTED_VLLM, check_vllm

VLLM_VERSION = check_vllm()

__all__ = ["SUPPORTED_VLLM", "VLLM_VERSION"]
