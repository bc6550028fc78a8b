from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[3]


def fixture_model_dir() -> Path:
    """The bundled tiny checkpoint (data/ in the repo), else the shared fixture beside the checkout."""
    for cand in (
        REPO / "data" / "tiny-qwen3-next-mtp",
        REPO.parent / "shared" / "fixtures" / "tiny-qwen3-next-mtp",
    ):
        if (cand / "config.json").is_file():
            return cand
    pytest.skip("tiny-qwen3-next-mtp checkpoint not found in data/ or ../shared/fixtures")


@pytest.fixture
def instruct_raw() -> dict:
    return json.loads((DATA / "qwen3-next-80b-a3b-instruct.json").read_text())


@pytest.fixture
def fp8_raw() -> dict:
    return json.loads((DATA / "qwen3-next-80b-a3b-instruct-fp8.json").read_text())


@pytest.fixture
def tiny_dir() -> Path:
    return fixture_model_dir()
