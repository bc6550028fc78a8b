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

    alloc = SlotAllocator(num_slots=3)
    s = alloc.allocate()
    assert s == 0
    alloc.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(s)
    t = alloc.allocate()
    with pytest.raises(RuntimeError, match="not allocated"):
        alloc.free(2)  # never handed out
    assert [alloc.allocate(), alloc.allocate()] == [1, 2] and alloc.num_free == 0
    with pytest.raises(RuntimeError, match="exhausted"):
        alloc.allocate()
    alloc.free(t)
    assert alloc.allocate() == t  # a freed slot is handed out again
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        SlotAllocator(0)


def _caches(cfg, k: int, max_num_seqs: int = 5):
    import torch
    from atom_models.engine.cache import EngineCaches

    return EngineCaches(
        cfg,
        num_blocks=4,
        block_size=16,
        max_num_seqs=max_num_seqs,
        num_speculative_tokens=k,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


@pytest.mark.parametrize("k", [0, 1, 3])
def test_gdn_state_is_one_slot_per_sequence_plus_pending(model_dir, k):
    """One conv row and ONE recurrent state per sequence whatever k; with MTP a float32 pending pool
    [S, 1 + k, P] per GDN layer (docs/kernel-api.md, deferred commit); none without."""
    import torch
    from atom_core import Qwen3NextConfig

    cfg = Qwen3NextConfig.from_hf(model_dir)
    caches = _caches(cfg, k)
    assert set(caches.gdn) == set(cfg.linear_attention_layers)
    hv, dv, dk = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim
    for state in caches.gdn.values():
        conv, ssm = state.conv, state.ssm
        assert conv.shape == (5, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1 + k), conv.shape
        assert ssm.shape == (5, hv, dv, dk) and ssm.dtype == torch.float32, ssm.shape
    p = cfg.linear_num_key_heads * dk + hv * dv + hv  # [k | u | g] per pending token
    if k == 0:
        assert all(state.pending is None for state in caches.gdn.values())
    else:
        for state in caches.gdn.values():
            pend = state.pending
            assert pend.shape == (5, 1 + k, p) and pend.dtype == torch.float32, pend.shape
    per_seq = caches.gdn_bytes_per_seq()
    layers = len(cfg.linear_attention_layers)
    assert per_seq["ssm"] == layers * hv * dv * dk * 4
    assert per_seq["pending"] == layers * (1 + k) * p * 4 * (k > 0)
