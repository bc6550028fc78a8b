"""Host arrays to the device without stalling the step.

A plain ``tensor.to(cuda)`` from pageable host memory makes torch wait for the stream (the copy is
issued and then synchronised), so a metadata builder that uploads a host-built index that way holds the
host until the GPU has finished every queued kernel: the next step's preparation no longer overlaps the
current step's forward (vLLM's async scheduling). :func:`to_device` stages the array in pinned memory from
torch's caching host allocator, which keeps the block until the asynchronous copy has run, and issues the
copy without a wait, as vLLM's own runners do for their per-step inputs.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``; on a CUDA device through pinned memory, without a host wait.

    The returned tensor is ready for kernels launched later on the current stream. The host array may be
    reused or freed as soon as this returns (the pinned staging copy is torch's, not the caller's)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return host.to(device, copy=True)
    return host.pin_memory().to(device, non_blocking=True)
