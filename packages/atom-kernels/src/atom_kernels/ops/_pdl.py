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
    """First statement of a kernel launched with ``launch_options``: wait for the previous kernel, then
    let the next one launch (no-op when ``PDL`` is False)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _capable(index: int) -> bool:
    """Whether CUDA device ``index`` can take PDL launches (CUDA, not ROCm; compute capability 9.0+)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


_PDL: Mapping[str, bool] = MappingProxyType({"PDL": True, "launch_pdl": True})
_NONE: Mapping[str, bool] = MappingProxyType({})


def launch_options(device: torch.device) -> Mapping[str, bool]:
    """``{"PDL": True, "launch_pdl": True}`` where PDL applies to a launch on ``device``, else ``{}``
    (read-only mappings, for ``**launch_options(device)``). Per launch: the tracing check, one read of
    ``ATOM_KERNELS_PDL`` and a cache lookup keyed on the device index and the variable's raw value."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return _NONE
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_options(index, os.environ.get(ATOM_KERNELS_PDL.name))


@functools.cache
def _cuda_options(index: int, switch: str | None) -> Mapping[str, bool]:
    """``launch_options`` of CUDA device ``index`` with ``ATOM_KERNELS_PDL`` set to ``switch`` (None: unset);
    a malformed value raises (and is not cached)."""
    requested = pdl_requested({} if switch is None else {ATOM_KERNELS_PDL.name: switch})
    return _PDL if requested and not interpreting() and _capable(index) else _NONE
