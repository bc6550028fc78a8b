"""``launch_options``: which launches take programmatic dependent launch, decided without a GPU (the
capability probe and the interpreter check are replaced). The answer of a CUDA device is cached per device
index and raw ``ATOM_KERNELS_PDL`` value, so toggling the variable within one process still takes effect,
and the capability probe runs once per (index, value)."""

from __future__ import annotations

import pytest
import torch
from atom_core.errors import ConfigError

# _pdl belongs to the Triton backend: an install of atom-kernels without triton (its dependency is optional)
# has nothing to test here
pytest.importorskip("triton", reason="the Triton backend's launch options need triton installed")
from atom_kernels.ops import _pdl  # noqa: E402

PDL = {"PDL": True, "launch_pdl": True}


@pytest.fixture
def probes(monkeypatch):
    """Device 0 capable, device 1 not; the interpreter off; returns the list of probed indices."""
    seen: list[int] = []

    def capable(index: int) -> bool:
        seen.append(index)
        return index == 0

    _pdl._cuda_options.cache_clear()
    monkeypatch.setattr(_pdl, "_capable", capable)
    monkeypatch.setattr(_pdl, "interpreting", lambda: False)
    monkeypatch.delenv("ATOM_KERNELS_PDL", raising=False)
    yield seen
    _pdl._cuda_options.cache_clear()


def test_cpu_launches_take_none():
    assert dict(_pdl.launch_options(torch.device("cpu"))) == {}


def test_capable_device_and_env_toggle(probes, monkeypatch):
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert dict(_pdl.launch_options(cuda0)) == PDL
    assert dict(_pdl.launch_options(cuda0)) == PDL
    assert probes == [0], "the capability probe ran again for a cached (device, switch)"
    assert dict(_pdl.launch_options(cuda1)) == {}, "a device below sm_90 took PDL"
    monkeypatch.setenv("ATOM_KERNELS_PDL", "0")
    assert dict(_pdl.launch_options(cuda0)) == {}, "ATOM_KERNELS_PDL=0 did not turn PDL off"
    monkeypatch.setenv("ATOM_KERNELS_PDL", "1")
    assert dict(_pdl.launch_options(cuda0)) == PDL, "ATOM_KERNELS_PDL=1 after =0 did not turn PDL back on"
    monkeypatch.delenv("ATOM_KERNELS_PDL")
    assert dict(_pdl.launch_options(cuda0)) == PDL
    assert probes == [0, 1, 0], probes  # unset and "1" are two keys; "0" never probes
    with pytest.raises(TypeError):
        _pdl.launch_options(cuda0)["PDL"] = False  # a shared cached answer: read-only


def test_malformed_switch_raises_every_time(probes, monkeypatch):
    monkeypatch.setenv("ATOM_KERNELS_PDL", "maybe")
    for _ in range(2):
        with pytest.raises(ConfigError, match="ATOM_KERNELS_PDL"):
            _pdl.launch_options(torch.device("cuda", 0))


def test_traced_launches_take_none(probes, monkeypatch):
    cuda0 = torch.device("cuda", 0)
    assert dict(_pdl.launch_options(cuda0)) == PDL
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dict(_pdl.launch_options(cuda0)) == {}, (
        "a launch traced by torch.compile took the cached PDL answer"
    )


def test_interpreter_takes_none(probes, monkeypatch):
    monkeypatch.setattr(_pdl, "interpreting", lambda: True)
    assert dict(_pdl.launch_options(torch.device("cuda", 0))) == {}, "Triton's interpreter took PDL"
