"""Device facts the Triton launch plans read (multiprocessor counts), cached per device."""

from __future__ import annotations

import functools

import torch

INTERPRETER_SMS = 4  # what a plan sees for CPU tensors (Triton's interpreter): small grids, quick tests


@functools.cache
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """The device's multiprocessor count (``INTERPRETER_SMS`` for CPU tensors)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
