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


def test_block_allocator_detects_double_and_foreign_free():
    from atom_models.engine.cache import BlockAllocator

    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    alloc.free(a)
    assert alloc.num_free == 8
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(a)
    b = alloc.allocate(2)
    with pytest.raises(RuntimeError, match="not allocated"):
        alloc.free([7])  # never handed out
    with pytest.raises(RuntimeError, match="not allocated"):
        alloc.free([b[0], b[0]])
    assert alloc.num_free == 6


def test_slot_allocator_detects_double_free():
    from atom_models.engine.cache import SlotAllocator

    alloc = SlotAllocator(num_groups=3, group=4)
    s = alloc.allocate()
    assert s == [0, 1, 2, 3] and alloc.group_of(s) == 0
    alloc.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(s)
    t = alloc.allocate()
    with pytest.raises(RuntimeError, match="not an allocated group"):
        alloc.free(t[1:])  # not the whole group
    with pytest.raises(RuntimeError, match="not an allocated group"):
        alloc.free([8, 9, 10, 11])  # group 2, never handed out
    assert alloc.num_free == 2


def test_conv_state_has_one_row_per_sequence(model_dir):
    import torch
    from atom_core import Qwen3NextConfig
    from atom_models.engine.cache import EngineCaches

    cfg = Qwen3NextConfig.from_hf(model_dir)
    caches = EngineCaches(
        cfg,
        num_blocks=4,
        block_size=16,
        max_num_seqs=5,
        num_speculative_tokens=3,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for conv, ssm in caches.gdn.values():
        assert conv.shape[0] == 5, conv.shape
        assert ssm.shape[0] == 5 * 4, ssm.shape
        assert conv.shape[2] == cfg.linear_conv_kernel_dim - 1 + 3
