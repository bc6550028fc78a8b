"""Device facts the Triton launch plans read (multiprocessor counts, names), cached per device."""

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


@functools.cache
def _cuda_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def device_name(device: torch.device) -> str:
    """The device's name as CUDA reports it (``"NVIDIA H100 80GB HBM3"``); ``"cpu"`` for CPU tensors."""
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
