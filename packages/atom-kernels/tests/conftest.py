"""Shared fixtures for the atom-kernels tests.

Device: ``--device cuda`` (or env ``ATOM_KERNELS_TEST_DEVICE=cuda``); default ``cpu``. Every test that
takes the ``backend`` fixture runs once per backend whose module imports on this machine (on CPU only
``reference``); the ``impl(op, dtype)`` fixture skips when that backend cannot run the op there.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from atom_kernels import registry

DEVICE_ENV = "ATOM_KERNELS_TEST_DEVICE"


def pytest_addoption(parser: pytest.Parser) -> None:
    # ValueError: another conftest of the workspace already defines --device; share it.
    with contextlib.suppress(ValueError):
        parser.addoption(
            "--device", default=None, help=f"device for kernel tests (default: ${DEVICE_ENV} or cpu)"
        )


def _device_name(config: pytest.Config) -> str:
    return config.getoption("--device", default=None) or os.environ.get(DEVICE_ENV) or "cpu"


def loadable_backends() -> list[str]:
    return [name for name in registry.BACKEND_MODULES if registry.load_backend(name) is None]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", loadable_backends())


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    dev = torch.device(_device_name(request.config))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda asked for, but torch.cuda is not available")
    return dev


@pytest.fixture
def impl(backend: str, device: torch.device):
    """``impl(op, dtype)``: the ``backend`` implementation of ``op``; skips the test when that backend
    cannot run the op on (device, dtype)."""

    def get(op: str, dtype: torch.dtype):
        try:
            return registry.resolve(op, device, dtype, backend).fn
        except registry.KernelBackendError as exc:
            pytest.skip(str(exc))

    return get


@pytest.fixture
def tol(request: pytest.FixtureRequest, backend: str):
    """``tol(what, dtype)``: ``(atol, rtol)`` from the test module's ``TOL`` table; an entry keyed
    ``(what, dtype, backend)`` (with its own measured-error comment) overrides ``(what, dtype)``."""
    table = request.module.TOL

    def get(what: str, dtype: torch.dtype) -> tuple[float, float]:
        return table.get((what, dtype, backend), table[(what, dtype)])

    return get
