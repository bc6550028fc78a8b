"""atom_core.paths finds the fixtures in the repository's data/ only; atom_core.testing turns a missing oracle
into a skip, or a failure under ATOM_REQUIRE_ORACLES=1."""

from __future__ import annotations

import unittest
from pathlib import Path

import pytest
from atom_core import ConfigError, envs, paths, testing


def test_fixtures_are_in_the_repository_data_dir():
    root = paths.repo_root()
    assert root is not None
    assert paths.default_model_dir() == root / "data" / paths.MODEL_NAME
    ref = paths.reference_dir()
    assert ref == root / "data" / paths.REFERENCE_NAME
    for name in ("golden.safetensors", "greedy.json", "prompts.json", "inputs.json"):
        assert (ref / name).is_file(), name


def test_data_root_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert envs.data_root({}) is None
    assert envs.data_root({"ATOM_DATA_ROOT": str(tmp_path)}) == tmp_path
    with pytest.raises(ConfigError, match="ATOM_DATA_ROOT"):
        envs.data_root({"ATOM_DATA_ROOT": str(tmp_path / "absent")})
    monkeypatch.setenv("ATOM_DATA_ROOT", str(tmp_path))
    assert paths.repo_root() == tmp_path
    want = tmp_path / "data" / paths.REFERENCE_NAME / "greedy.json"
    with pytest.raises(FileNotFoundError, match=f"missing {want}"):
        paths.reference_dir()


def test_require_oracles_switch():
    assert envs.oracles_required({}) is False
    assert envs.oracles_required({"ATOM_REQUIRE_ORACLES": "1"}) is True
    with pytest.raises(ConfigError, match="ATOM_REQUIRE_ORACLES"):
        envs.oracles_required({"ATOM_REQUIRE_ORACLES": "maybe"})


@pytest.mark.parametrize("required", ["0", "1"])
def test_missing_oracle_skips_or_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, required: str):
    monkeypatch.setenv("ATOM_REQUIRE_ORACLES", required)
    monkeypatch.setenv("ATOM_DATA_ROOT", str(tmp_path))
    outcome = testing.MissingOracle if required == "1" else unittest.SkipTest
    with pytest.raises(outcome, match="greedy.json"):
        testing.reference_dir()
    with pytest.raises(outcome, match="no_such_module_atom"):
        testing.import_oracle("no_such_module_atom")
    monkeypatch.delenv("ATOM_DATA_ROOT")
    assert testing.reference_file("golden.safetensors").is_file()
