"""Copy whole KV-cache pages in vLLM's copy-on-write of partial prefix-cache hits (vLLM 0.32).

Why: with a prefix hit that ends inside a block (``prefix_match_unit`` finer than the block size, or a
prompt's last hash boundary in vLLM's Mamba "align" mode) vLLM's scheduler hands the request a private copy
of the shared block, and the model runner copies the block's bytes in every layer before the step
(``vllm.v1.worker.utils.copy_kv_cache_blocks_inplace``). That function copies one view per data pointer: in
a hybrid model a Mamba layer and an attention layer share each raw KV-cache tensor, the first view listed
is a GDN layer's (layers are listed by index), and its rows cover only the GDN state bytes of a block, not
the attention page they are padded to. The attention block's tail is not copied: for the bundled model
(float32, MTP) positions 140..255 of a 256-token attention block stayed zero in the copy, so a request
resuming 448 tokens in read a zeroed key/value for tokens 396..447 and emitted wrong tokens a few steps
later (prefix caching on != off). vLLM's fast path (whole rows of the allocation) hides this where the
allocation holds a single KV-cache tensor; the bundled model with MTP (3 GDN and 2 attention layers) has two
(without MTP its hits inside a block were exact). The replacement copies every distinct view (data pointer, shape, strides, dtype), so
overlapping views of one tensor are all copied in full; the copied pairs are a scheduler's CoW
pairs (fresh destinations, never a source), so the order of the copies does not matter.

Extension point: none; vLLM's V1 and V2 model runners call the name imported into their modules, which is
replaced there.

vLLM bug: the same one reported for Kimi-K3 in vllm-project/vllm#55112 (an open fix, not in 0.32);
``tests/test_patches_still_needed.py`` fails once vLLM's function copies the full page of every view.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from atom_vllm_plugin.layers.host_copy import to_device

RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
FUNCTION = "copy_kv_cache_blocks_inplace"


def copy_blocks_every_view(kv_caches: Iterable[torch.Tensor], num_blocks: int, copies: Sequence) -> None:
    """``view[dst] = view[src]`` for every ``(src, dst)`` block pair of ``copies`` in every distinct view of
    ``kv_caches`` (dim 0 of a view: ``num_blocks`` scheduler blocks, or a whole multiple of it in kernel
    blocks). Nothing to copy: nothing runs."""
    if not copies:
        return
    pairs = np.asarray([(c[0], c[1]) for c in copies], dtype=np.int64)
    index: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    seen: set[tuple] = set()
    for cache in kv_caches:
        key = (cache.device, cache.data_ptr(), tuple(cache.shape), cache.stride(), cache.dtype)
        if key in seen or cache.numel() == 0:
            continue
        seen.add(key)
        if cache.shape[0] % num_blocks:
            raise ValueError(
                f"KV-cache view of {cache.shape[0]} rows is not a whole number of kernel blocks per each of "
                f"{num_blocks} scheduler blocks"
            )
        if cache.device not in index:
            t = to_device(pairs, cache.device)
            index[cache.device] = (t[:, 0], t[:, 1])
        src, dst = index[cache.device]
        blocks = cache.unflatten(0, (num_blocks, cache.shape[0] // num_blocks))
        blocks[dst] = blocks[src]


def apply() -> bool:
    """Replace the runners' ``copy_kv_cache_blocks_inplace``; return True (idempotent)."""
    import importlib

    for name in RUNNER_MODULES:
        module = importlib.import_module(name)
        current = getattr(module, FUNCTION, None)
        if current is None:
            raise RuntimeError(
                f"{name}.{FUNCTION} is gone; atom_vllm_plugin.patches.kv_block_copy must be revisited for "
                "this vLLM version"
            )
        if current is not copy_blocks_every_view:
            setattr(module, FUNCTION, copy_blocks_every_view)
    return True
