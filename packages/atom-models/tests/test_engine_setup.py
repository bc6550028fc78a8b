"""Engine construction: config validation, injected kernels, cache sizing, allocators (no model weights)."""

from __future__ import annotations

import pytest
from atom_models.engine import EngineConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_blocks", 0),
        ("num_blocks", -3),
        ("block_size", 0),
        ("max_num_seqs", 0),
        ("max_model_len", 0),
        ("max_num_batched_tokens", 0),
        ("num_speculative_tokens", -1),
        ("num_blocks", True),
        ("max_num_seqs", 2.0),
    ],
)
def test_engine_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**{field: value})


def test_engine_config_num_blocks_none_means_default():
    assert EngineConfig().num_blocks is None
    assert EngineConfig(num_blocks=1).num_blocks == 1


def test_injected_kernels_must_match_engine_dtype_and_device(model_dir):
    import torch
    from atom_core import Qwen3NextConfig
    from atom_kernels import select_kernels
    from atom_models.engine import LLMEngine

    cfg = Qwen3NextConfig.from_hf(model_dir)
    k32 = select_kernels(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"kernels: selected for device cpu / dtype torch.float32.*bfloat16"):
        LLMEngine(cfg, EngineConfig(max_model_len=64, max_num_seqs=1), dtype=torch.bfloat16, kernels=k32)
    with pytest.raises(ValueError, match=r"engine runs on device meta"):
        LLMEngine(cfg, EngineConfig(max_model_len=64, max_num_seqs=1), device="meta", kernels=k32)
    eng = LLMEngine(cfg, EngineConfig(max_model_len=64, max_num_seqs=1), kernels=k32)
    assert eng.kernels is k32
