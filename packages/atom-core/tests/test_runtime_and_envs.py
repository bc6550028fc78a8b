from __future__ import annotations

import pytest
from atom_core import CacheConfig, ConfigError, SpeculativeConfig, envs


def test_speculative_config():
    s = SpeculativeConfig(method="mtp", num_speculative_tokens=3)
    assert s.num_speculative_tokens == 3


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"method": "eagle", "num_speculative_tokens": 1}, "method"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": "2"}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ],
)
def test_speculative_config_bad(kwargs, field):
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig(**kwargs)
    assert err.value.field == field


def test_speculative_direct_construction_validates():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)


def test_cache_config():
    assert CacheConfig(block_size=16, kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=0)


@pytest.mark.parametrize("value,expected", [("0", False), ("1", True), ("true", True), ("off", False)])
def test_plugin_disabled(value, expected):
    assert envs.plugin_disabled({"ATOM_DISABLE_VLLM_PLUGIN": value}) is expected


def test_plugin_disabled_default_and_malformed():
    assert envs.plugin_disabled({}) is False
    with pytest.raises(ConfigError) as err:
        envs.plugin_disabled({"ATOM_DISABLE_VLLM_PLUGIN": "maybe"})
    assert err.value.field == "ATOM_DISABLE_VLLM_PLUGIN" and err.value.value == "maybe"


def test_forced_kernel_backend():
    assert envs.forced_kernel_backend({}) is None
    assert envs.forced_kernel_backend({"ATOM_KERNEL_BACKEND": "Triton"}) == "triton"
    with pytest.raises(ConfigError, match="ATOM_KERNEL_BACKEND"):
        envs.forced_kernel_backend({"ATOM_KERNEL_BACKEND": "cuda"})


def test_every_switch_is_documented():
    switches = [v for v in vars(envs).values() if isinstance(v, envs.EnvSwitch)]
    assert {s.name for s in switches} == {
        "ATOM_DISABLE_VLLM_PLUGIN",
        "ATOM_KERNEL_BACKEND",
        "ATOM_KERNELS_PDL",
        "ATOM_DATA_ROOT",
        "ATOM_REQUIRE_ORACLES",
    }
    for switch in switches:
        assert switch.name in envs.__doc__


def test_pdl_switch():
    assert envs.pdl_requested({}) is True
    assert envs.pdl_requested({"ATOM_KERNELS_PDL": "0"}) is False
    assert envs.pdl_requested({"ATOM_KERNELS_PDL": "1"}) is True
    with pytest.raises(ConfigError, match="ATOM_KERNELS_PDL"):
        envs.pdl_requested({"ATOM_KERNELS_PDL": "maybe"})


def test_speculative_tokens_capped():
    from atom_core import MAX_SPECULATIVE_TOKENS

    assert SpeculativeConfig(num_speculative_tokens=MAX_SPECULATIVE_TOKENS).num_speculative_tokens == 8
    with pytest.raises(ConfigError, match=rf"must be in \[1, {MAX_SPECULATIVE_TOKENS}\]"):
        SpeculativeConfig(num_speculative_tokens=MAX_SPECULATIVE_TOKENS + 1)
