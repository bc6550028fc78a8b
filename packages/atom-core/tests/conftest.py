from __future__ import annotations

import json
from pathlib import Path

import pytest
from atom_core import testing

DATA = Path(__file__).parent / "data"


@pytest.fixture
def instruct_raw() -> dict:
    return json.loads((DATA / "qwen3-next-80b-a3b-instruct.json").read_text())


@pytest.fixture
def fp8_raw() -> dict:
    return json.loads((DATA / "qwen3-next-80b-a3b-instruct-fp8.json").read_text())


@pytest.fixture
def tiny_dir() -> Path:
    return testing.model_dir()
