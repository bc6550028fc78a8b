"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (Hopper and later).

A decode step at batch 1 is several hundred short kernels in a row. Launched with PDL
(``launch_pdl=True``) a kernel may be scheduled while the kernel before it on the stream still runs, so
its launch and start overlap that kernel's tail instead of following its completion. Every kernel that
takes the ``PDL`` flag calls :func:`pdl_enter` as its FIRST statement: ``griddepcontrol.wait`` holds it
until the previous kernel has completed and its writes are visible (nothing of the kernel reads or writes
memory before it), then ``griddepcontrol.launch_dependents`` lets the next kernel launch. Since each such
kernel completes only after the one before it, completion order along the stream is unchanged; a kernel
without PDL (cuBLAS, torch) waits for full completion as usual. CUDA graphs keep the launches'
programmatic edges.

:func:`launch_options` gives the launch keywords: ``PDL=True, launch_pdl=True`` on CUDA devices of compute
capability 9.0 or newer unless ``ATOM_KERNELS_PDL=0``; otherwise none (the flag defaults to False, and
ROCm, older GPUs and Triton's CPU interpreter never see the instructions). Launches traced by
``torch.compile`` (vLLM's compiled model) take none: PDL there waits for a test with vLLM on a GPU.
H200 (``bench_pdl.py``): a graphed chain of GEMV launches takes 1.26 instead of 1.58 us per 128 KB kernel
and 4.12 instead of 4.48 us per 8 MB kernel.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from atom_core.envs import ATOM_KERNELS_PDL, pdl_requested
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from atom_kernels.ops._triton_env import interpreting


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First memory-touching statement of a kernel launched with ``launch_options``: wait for the previous
    kernel and let the next one launch (no-op when ``PDL`` is 0). ``PDL == 2`` lets the next one launch
    before waiting (experiment: deeper overlap)."""
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptrs):
    """Ask the L2 cache for the 128-byte line of each address of ``ptrs`` (``prefetch.global.L2``: a
    hint, no registers, nothing to wait for)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


def _capable(index: int) -> bool:
    """Whether CUDA device ``index`` can take PDL launches (CUDA, not ROCm; compute capability 9.0+)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def prefetch_rows(ptr, rows, n_rows, stride, col0, ncols, LINES: tl.constexpr = 16):
    """:func:`l2_prefetch` of the lines holding columns ``[col0, col0 + ncols)`` of each row in ``rows``
    (clamped to ``n_rows - 1``) of the row-major matrix at ``ptr`` (``stride`` elements per row), ``LINES``
    lines of every row per round. Kernels call it on their static weights before :func:`pdl_enter`, so
    that the weight stream starts while the previous kernel still runs."""
    r = tl.minimum(rows, n_rows - 1).to(tl.int64)
    step = 1024 // ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    lines = tl.arange(0, LINES) * step
    last = col0 + ncols - 1
    for c in range(col0, col0 + ncols, LINES * step):
        offs = tl.minimum(c + lines, last)
        l2_prefetch(ptr + r[:, None] * stride + offs[None, :])


def prefetchable(w: torch.Tensor, *col_steps: int) -> bool:
    """Whether :func:`prefetch_rows` may run over ``w`` (rows along its last dimension, unit last stride; a
    leading dimension, e.g. experts, is a stack of such matrices): its start, its strides and every column
    step the kernel starts a range at or ends it on (``col_steps``, in elements) are multiples of 16
    bytes."""
    es = w.element_size()
    steps = (*w.stride()[:-1], w.shape[-1], *col_steps)
    return w.stride(-1) == 1 and w.data_ptr() % 16 == 0 and all((c * es) % 16 == 0 for c in steps)


_PDL: Mapping[str, bool] = MappingProxyType({"PDL": True, "launch_pdl": True})
_NONE: Mapping[str, bool] = MappingProxyType({})
_PREFETCH: Mapping[str, bool] = MappingProxyType({"PREFETCH": True})
_EXP = "ATOM_KERNELS_PDL_EXP"  # experiment: "trigger_first", "prefetch" (comma-separated)


def _exp() -> set[str]:
    return {t.strip() for t in os.environ.get(_EXP, "").split(",") if t.strip()}


def prefetch_options(w: torch.Tensor, *col_steps: int) -> Mapping[str, bool]:
    """``{"PREFETCH": True}`` where a kernel launched with PDL prefetches its static weight ``w`` into L2
    before its wait (:func:`prefetch_rows`; ``col_steps``: see :func:`prefetchable`), else ``{}``."""
    if launch_options(w.device) and "prefetch" in _exp() and prefetchable(w, *col_steps):
        return _PREFETCH
    return _NONE


def experts_prefetch_options(w: torch.Tensor, *col_steps: int) -> Mapping[str, bool]:
    """``{"PREFETCH": True}`` where the MoE pair kernels bulk-prefetch their expert's weight slice into L2
    right after the PDL wait (the expert ids are known only then), else ``{}``."""
    if launch_options(w.device) and "moe_prefetch" in _exp() and prefetchable(w, *col_steps):
        return _PREFETCH
    return _NONE


def launch_options(device: torch.device) -> Mapping[str, bool]:
    """``{"PDL": True, "launch_pdl": True}`` where PDL applies to a launch on ``device``, else ``{}``
    (read-only mappings, for ``**launch_options(device)``). Per launch: the tracing check, one read of
    ``ATOM_KERNELS_PDL`` and a cache lookup keyed on the device index and the variable's raw value."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return _NONE
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_options(index, os.environ.get(ATOM_KERNELS_PDL.name), os.environ.get(_EXP))


@functools.cache
def _cuda_options(index: int, switch: str | None, exp: str | None = None) -> Mapping[str, bool]:
    """``launch_options`` of CUDA device ``index`` with ``ATOM_KERNELS_PDL`` set to ``switch`` (None: unset);
    a malformed value raises (and is not cached)."""
    requested = pdl_requested({} if switch is None else {ATOM_KERNELS_PDL.name: switch})
    if not (requested and not interpreting() and _capable(index)):
        return _NONE
    return MappingProxyType({"PDL": 2, "launch_pdl": True}) if "trigger_first" in _exp() else _PDL
