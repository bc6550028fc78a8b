"""Stop tokens from generation_config.json beside config.json."""

from __future__ import annotations

import json
import os

import pytest
from atom_core import ConfigError, Qwen3NextConfig
from atom_models.generation_config import generation_eos_ids, with_generation_eos


def _ckpt(tmp_path, model_dir, gen: dict | str | None):
    """A checkpoint dir linking the fixture's files, with our own generation_config.json (or none)."""
    for name in os.listdir(model_dir):
        if name != "generation_config.json":
            (tmp_path / name).symlink_to(model_dir / name)
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(gen if isinstance(gen, str) else json.dumps(gen))
    return tmp_path


@pytest.mark.parametrize(
    "gen, want",
    [({"eos_token_id": 7}, (7,)), ({"eos_token_id": [5, 9]}, (5, 9)), ({"bos_token_id": 1}, ()), (None, ())],
)
def test_generation_eos_ids(tmp_path, model_dir, gen, want):
    assert generation_eos_ids(_ckpt(tmp_path, model_dir, gen)) == want


@pytest.mark.parametrize("bad", [True, [151645, True], "151645", -1, [1.5]])
def test_generation_eos_ids_rejects_non_ids(tmp_path, model_dir, bad):
    d = _ckpt(tmp_path, model_dir, {"eos_token_id": bad})
    with pytest.raises(ConfigError, match=r"generation_config\.json: field 'eos_token_id'"):
        generation_eos_ids(d)


def test_generation_eos_rejects_bad_json_and_out_of_vocab(tmp_path, model_dir):
    d = _ckpt(tmp_path, model_dir, "{not json")
    with pytest.raises(ConfigError, match="generation_config.json.*not valid JSON"):
        generation_eos_ids(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 10**9]}))
    with pytest.raises(ConfigError, match="eos_token_id.*vocab_size"):
        with_generation_eos(Qwen3NextConfig.from_hf(d), d)


def test_engine_stops_on_generation_config_eos(tmp_path, model_dir, greedy_cases):
    """config.json's eos (0) never comes up in this greedy continuation; generation_config.json adds
    another id that does, and the engine (from_pretrained, as the CLI uses it) stops there."""
    from atom_models.engine import EngineConfig, LLMEngine, SamplingParams

    case = greedy_cases["cases"][2]
    stop = case["greedy_ids"][9]
    cut = case["greedy_ids"].index(stop)
    assert 0 not in case["greedy_ids"][: cut + 1]
    d = _ckpt(tmp_path, model_dir, {"eos_token_id": [0, stop]})
    eng = LLMEngine.from_pretrained(d, EngineConfig(max_model_len=256, max_num_seqs=1))
    assert eng.config.eos_token_id == (0, stop)
    res = eng.generate([case["prompt_ids"]], SamplingParams(max_tokens=32))[0]
    assert res.finish_reason == "stop"
    assert res.output_ids == case["greedy_ids"][: cut + 1]
