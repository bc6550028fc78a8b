"""Monkey patches of vLLM, applied from :func:`atom_vllm_plugin.register.register`.

Policy: a patch only where vLLM has no extension point, one module per patch, each written against the
vLLM minor version in :data:`PATCHED_VLLM` (checked before anything is patched) and commented with why it
is needed, naming the vLLM bug (``tests/test_patches_still_needed.py`` runs vLLM's unpatched code and fails
once vLLM no longer has the bug):

- :mod:`.cpu_expand_kernel`: vLLM-CPU's replacement for the rejection sampler's ``expand_kernel`` leaves
  its output uninitialised for float32/int32 tensors, which corrupts every speculative batch that mixes
  greedy and sampled requests (wrong tokens, ``top_k`` crashes, unreproducible seeds): vLLM issue
  vllm-project/vllm#55005 (fix proposed in vllm-project/vllm#55006, not in 0.32).
- :mod:`.top_k_empty_batch`: vLLM's PyTorch ``apply_top_k_only`` raises on zero rows, which the rejection
  sampler passes in every prefill-only step: one ``top_k`` request killed the engine on vLLM-CPU (no upstream
  vLLM issue found).
- :mod:`.cpu_seeded_rewind`: vLLM rewinds a seeded request's generator by a CUDA Philox offset when it
  discards a sample (partly prefilled prompts); CPU generators have no offset, so on vLLM-CPU one seeded
  request arriving under load killed the engine. The CPU rewind restores the generator's saved state. (The
  offset rewind came with vllm-project/vllm#10097; no upstream issue for CPU generators found.)
- :mod:`.kv_block_copy`: vLLM's copy-on-write of a block that a prefix hit ends inside copies one view per
  shared KV-cache tensor; in a hybrid model that is a GDN layer's view, which covers only the state bytes
  of the page, so the attention block's tail is lost (wrong tokens with ``prefix_match_unit`` below the
  block size). The replacement copies every view in full (vllm-project/vllm#55112, open, not in 0.32).
- :mod:`.mamba_align`: with prefix caching (vLLM's default) vLLM's V1 runner copies Mamba states between
  "align" blocks with per-token-state assumptions and Triton kernels (absent on vLLM-CPU); for ATOM's GDN
  cores it only records each request's state block and publishes the whole-slot copies that the GDN
  layers run on the device. (Model Runner V2 takes the target's own model state instead, an extension
  point, not a patch: ``atom_vllm_plugin.model_state``.)
"""

from __future__ import annotations

import logging

from atom_vllm_plugin._version_check import SUPPORTED_VLLM, installed_vllm_version
from atom_vllm_plugin.patches import (
    cpu_expand_kernel,
    cpu_seeded_rewind,
    kv_block_copy,
    mamba_align,
    top_k_empty_batch,
)

logger = logging.getLogger("vllm.atom_vllm_plugin")

PATCHED_VLLM = SUPPORTED_VLLM
"""The vLLM minor version whose internals these patches were written against."""

_PATCHES = {
    "cpu_expand_kernel": cpu_expand_kernel.apply,
    "top_k_empty_batch": top_k_empty_batch.apply,
    "cpu_seeded_rewind": cpu_seeded_rewind.apply,
    "mamba_align": mamba_align.apply,
    "kv_block_copy": kv_block_copy.apply,
}


def apply_patches(version: str | None = None) -> list[str]:
    """Apply every patch that concerns this platform; return the names applied.

    Raises ``RuntimeError`` naming the version when the installed vLLM is not ``PATCHED_VLLM``.x: the
    patched internals may have changed, and a stale patch is worse than none.
    """
    version = version or installed_vllm_version()
    if version is None or ".".join(version.split(".")[:2]) != PATCHED_VLLM:
        raise RuntimeError(
            f"atom_vllm_plugin's vLLM patches are written for vLLM {PATCHED_VLLM}.x, found {version}"
        )
    applied = [name for name, apply in _PATCHES.items() if apply()]
    if applied:
        logger.info("ATOM vLLM plugin patched vLLM %s: %s", version, ", ".join(applied))
    return applied
