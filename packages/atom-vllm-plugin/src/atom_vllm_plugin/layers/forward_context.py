"""Read this layer's metadata out of vLLM's per-forward context (the ``ctx`` our cores ignore)."""

from __future__ import annotations

from typing import Any

from vllm.forward_context import get_forward_context, is_forward_context_available


def layer_metadata(layer_name: str) -> Any | None:
    """The attention metadata vLLM built for ``layer_name`` this step, or None (profiling / dummy runs)."""
    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if md is None:
        return None
    if isinstance(md, list):  # ubatching: [0] is the base model's
        md = md[0]
    if isinstance(md, dict):
        return md.get(layer_name)
    return md
