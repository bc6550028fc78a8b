from __future__ import annotations

import json
from pathlib import Path

import pytest
from atom_core.paths import default_model_dir

DATA = Path(__file__).parent / "data"


@pytest.fixture
def instruct_raw() -> dict:
    return json.loads((DATA / "qwen3-next-80b-a3b-instruct.json").read_text())


@pytest.fixture
def fp8_raw() -> dict:
    return json.loads((DATA / "qwen3-next-80b-a3b-instruct-fp8.json").read_text())


@pytest.fixture
def tiny_dir() -> Path:
    try:
        return default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
