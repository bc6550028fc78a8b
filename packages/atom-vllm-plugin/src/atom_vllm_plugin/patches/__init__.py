"""Monkey patches of vLLM, applied from :func:`atom_vllm_plugin.register.register`.

Policy (DESIGN.md section 2): a patch only where vLLM has no extension point, one module per patch,
each guarded by the vLLM version it was written against and commented with why it is needed.
The plugin currently needs none: attention and GDN plug in through ``AttentionLayerBase`` / ``MambaBase``
layers with their own backends, and the draft through vLLM's ModelRegistry.
"""

from __future__ import annotations

_applied = False


def apply_patches() -> list[str]:
    """Apply every patch once; return the names of the patches applied (empty: none are needed)."""
    global _applied
    applied: list[str] = []
    _applied = True
    return applied
