"""Which vLLM GPU model runner serves the plugin's models: Model Runner V2 unless prefix caching is on.

vLLM 0.32 has two GPU model runners. ``VllmConfig.use_v2_model_runner`` (``vllm/config/vllm.py``) picks
Model Runner V2 (``vllm/v1/worker/gpu/``) wherever Triton is importable and no feature V2 lacks is asked
for, unless ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise; vLLM-CPU has no Triton and always runs V1 (its CPU
runner subclasses V1's GPU runner).

The plugin's metadata builders, GDN state and MTP draft run under both (measured on an H100 with the
bundled model, float32, full CUDA graphs, async scheduling: ``greedy.json`` exact at k = 1 and 3 with V1's
acceptance). V2 overlaps the next step's host work with the GPU's and captures the MTP draft in a full
graph, where V1 captures it only piecewise; at 80B-A3B width it runs the concurrency-1 decode step 1.6x
faster (``docs/performance.md``). What V2 cannot do for the plugin is prefix caching: its Mamba "align"
mode copies a request's state between blocks with its own fused kernels, which move two of the four
tensors of the plugin's deferred-commit GDN state and reset the accepted count the state still has to
commit, so the tokens after a prefix hit would be wrong without an error. The plugin's align-mode copies
(``patches.mamba_align``) hook V1's runner.

So, on CUDA and ROCm, :func:`select_model_runner` (called from the target's config hook,
:mod:`atom_vllm_plugin.config_hook`, where the ``VllmConfig`` being built shows whether prefix caching is
on) leaves vLLM's own choice (V2) when prefix caching is off, and sets ``VLLM_USE_V2_MODEL_RUNNER=0`` (V1)
when it is on. A user's own ``VLLM_USE_V2_MODEL_RUNNER`` is kept; ``=1`` together with prefix caching is
refused with an error naming both. The variable is vLLM's documented switch; ``vllm.envs`` reads it on every
access until vLLM caches its environment once the engine has started, and the engine core and workers,
started after the config is built, inherit it. ``ATOM_SET_VLLM_USE_V2_MODEL_RUNNER`` marks a value the
plugin wrote, so that a later config in the same process (another ``LLM``) is decided afresh. No vLLM code
is patched. Features that only V2 has (HiSparse, watermarking) make vLLM pick V2 whatever the variable says.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.atom_vllm_plugin")

ENV = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's switch between its GPU model runners (unset: vLLM decides; ``0``: V1; ``1``: V2)."""
MARK = "ATOM_SET_VLLM_USE_V2_MODEL_RUNNER"
"""Set to ``1`` beside :data:`ENV` when the plugin wrote :data:`ENV` (its value is then not the user's)."""


@dataclass(frozen=True)
class RunnerChoice:
    """What the plugin does about ``VLLM_USE_V2_MODEL_RUNNER``: the value to set (None: leave the
    environment as it is), the log level and the message naming the reason."""

    set_env: str | None
    level: int
    message: str


def choose_model_runner(
    gpu_platform: str | None, user_value: str | None, prefix_caching: bool
) -> RunnerChoice:
    """Decide from the platform (``gpu_platform``: ``"cuda"`` / ``"rocm"``, or None where vLLM has no V2
    runner, as on vLLM-CPU), the user's ``VLLM_USE_V2_MODEL_RUNNER`` (None: unset) and whether the config
    has prefix caching on. Raises ``ValueError`` for V2 asked for together with prefix caching."""
    if gpu_platform is None:
        return RunnerChoice(None, logging.DEBUG, "no GPU platform: vLLM chooses its model runner")
    if user_value is None:
        if prefix_caching:
            return RunnerChoice(
                "0",
                logging.INFO,
                f"ATOM vLLM plugin selects vLLM's V1 GPU model runner on {gpu_platform} ({ENV}=0): prefix "
                "caching is on, and Model Runner V2's align-mode state copies do not keep the plugin's "
                "deferred-commit GDN state. --no-enable-prefix-caching runs Model Runner V2.",
            )
        return RunnerChoice(
            None,
            logging.INFO,
            f"ATOM vLLM plugin runs with vLLM's choice of GPU model runner on {gpu_platform} (Model Runner V2 "
            f"unless a feature it lacks is asked for; {ENV}=0 selects V1)",
        )
    try:
        wants_v2 = bool(int(user_value))
    except ValueError:
        return RunnerChoice(
            None,
            logging.WARNING,
            f"{ENV}={user_value!r} is not an integer (vLLM reads it with int()); the ATOM vLLM plugin leaves it "
            "as it is",
        )
    if wants_v2 and prefix_caching:
        raise ValueError(
            f"{ENV}={user_value} with prefix caching on: Model Runner V2's align-mode state copies do not keep "
            "the ATOM plugin's deferred-commit GDN state (the tokens after a prefix hit would be wrong). Pass "
            f"--no-enable-prefix-caching (LLM(enable_prefix_caching=False)), or unset {ENV} to serve prefix "
            "caching with vLLM's V1 runner."
        )
    runner = "Model Runner V2" if wants_v2 else "the V1 GPU model runner"
    return RunnerChoice(
        None, logging.INFO, f"ATOM vLLM plugin runs with {runner} on {gpu_platform} ({ENV}={user_value})"
    )


def gpu_platform_name(platform: Any) -> str | None:
    """``"cuda"`` / ``"rocm"`` for vLLM platforms on which vLLM 0.32 may choose Model Runner V2, else None."""
    if platform.is_cuda():
        return "cuda"
    if platform.is_rocm():
        return "rocm"
    return None


def _current_platform() -> Any:
    from vllm.platforms import current_platform

    return current_platform


def select_model_runner(
    prefix_caching: bool, environ: MutableMapping[str, str] | None = None, platform: Any | None = None
) -> RunnerChoice:
    """Apply :func:`choose_model_runner` for vLLM's current platform to ``environ`` (``os.environ``) and log
    its one line; return the choice. A value of :data:`ENV` that the plugin wrote earlier (:data:`MARK`)
    counts as unset."""
    environ = os.environ if environ is None else environ
    platform = _current_platform() if platform is None else platform
    plugin_written = environ.get(MARK) == "1"
    user_value = None if plugin_written else environ.get(ENV)
    choice = choose_model_runner(gpu_platform_name(platform), user_value, prefix_caching)
    if plugin_written:
        environ.pop(ENV, None)
        environ.pop(MARK, None)
    if choice.set_env is not None:
        environ[ENV] = choice.set_env
        environ[MARK] = "1"
    if environ is os.environ and (plugin_written or choice.set_env is not None):
        _check_vllm_sees(environ.get(ENV))
    logger.log(choice.level, "%s", choice.message)
    return choice


def _check_vllm_sees(value: str | None) -> None:
    """Warn where ``vllm.envs`` already cached its environment (the variable would then come too late)."""
    import vllm.envs as envs

    expected = None if value is None else bool(int(value))
    if envs.VLLM_USE_V2_MODEL_RUNNER is not expected:
        logger.warning(
            "%s=%s was set after vLLM cached its environment; this process keeps %s=%s",
            ENV,
            value,
            ENV,
            envs.VLLM_USE_V2_MODEL_RUNNER,
        )
