"""Let vLLM's PyTorch top-k path take a batch of zero rows (vLLM 0.32).

Why: with speculative decoding vLLM's model runner always samples through the rejection sampler, also in
steps where no request has draft tokens (every step that only prefills). The sampler then applies the
sampling constraints to a ``[0, vocab]`` tensor of draft logits. Where vLLM has no Triton (vLLM-CPU), a
batch with ``top_k`` and no ``top_p`` goes to ``topk_topp_sampler.apply_top_k_only``, whose ``k.max()``
raises on an empty tensor: the worker fails, the engine dies and the server exits with it. One request with
``top_k`` is enough. Zero rows have nothing to mask, so the corrected function returns them unchanged.

Extension point: none; ``apply_top_k_top_p_pytorch`` calls the module attribute, which is replaced here.

vLLM bug: no upstream issue found; ``tests/test_patches_still_needed.py`` fails once vLLM's
``apply_top_k_only`` takes zero rows.
"""

from __future__ import annotations

import functools

import torch


def apply() -> bool:
    """Wrap ``apply_top_k_only``; return True (idempotent)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    original = topk_topp_sampler.apply_top_k_only
    if getattr(original, "atom_patched", False):
        return True

    @functools.wraps(original)
    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return original(logits, k)

    apply_top_k_only.atom_patched = True
    topk_topp_sampler.apply_top_k_only = apply_top_k_only
    return True
