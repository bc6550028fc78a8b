"""``layers.host_copy.to_device``: the values arrive, the caller's array is free to change afterwards."""

import numpy as np
import pytest
import torch
from atom_vllm_plugin.layers.host_copy import to_device


def _check(device: str) -> None:
    a = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]  # not contiguous
    t = to_device(a, torch.device(device))
    expected = torch.from_numpy(a.copy())
    a[:] = -1  # the caller reuses its array at once
    assert t.device.type == device
    assert t.dtype == torch.int64
    assert torch.equal(t.cpu(), expected), (t, expected)


def test_to_device_cpu_copies() -> None:
    _check("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned staging path)")
def test_to_device_cuda_pinned_async() -> None:
    _check("cuda")
