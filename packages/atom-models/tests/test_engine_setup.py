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
