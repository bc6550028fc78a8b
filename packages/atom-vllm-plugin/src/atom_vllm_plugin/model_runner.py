"""Which vLLM GPU model runner serves the plugin's models: V1 (``GPUModelRunner``), chosen explicitly.

vLLM 0.32 has two GPU model runners. ``VllmConfig.use_v2_model_runner`` (``vllm/config/vllm.py``) picks
Model Runner V2 (``vllm/v1/worker/gpu/``) wherever Triton is importable and no feature V2 lacks is asked
for, unless ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise; vLLM-CPU has no Triton and always runs V1. The
plugin's attention and GDN metadata builders, its deferred-commit GDN state and its MTP draft are written
against V1's ``GPUModelRunner`` / ``EagleProposer`` (the runner vLLM-CPU subclasses) and have never run
under V2, which builds their metadata differently (dummy metadata in piecewise capture and dummy runs,
a prompt's last token run as a speculative row, the target's metadata reused for the draft's first
step, ``num_accepted_tokens`` kept on the GPU by ``MambaHybridModelState``).

So on CUDA and ROCm, :func:`pin_v1_model_runner` sets ``VLLM_USE_V2_MODEL_RUNNER=0`` unless the user set
the variable. It runs from :func:`atom_vllm_plugin.register.register`, which vLLM calls from
``EngineArgs.__post_init__`` (and ``AsyncEngineArgs.add_cli_args`` for ``vllm serve``) before the
``VllmConfig`` exists, and again in the engine core and in every worker before they read the property; the
variable also reaches those processes through the environment they inherit. The front-end process calls
it before vLLM configures its logging, so the line that shows is the engine core's ("... V1 GPU model
runner ... VLLM_USE_V2_MODEL_RUNNER=0 in the environment"). ``vllm.envs`` reads it on
every access until vLLM caches its environment once the engine has started. No vLLM code is patched: the
variable is vLLM's documented switch.

A user's own ``VLLM_USE_V2_MODEL_RUNNER=1`` is kept, with a warning that V2 is untested with the plugin.
Features that only V2 has (HiSparse, watermarking) make vLLM pick V2 whatever the variable says.
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


@dataclass(frozen=True)
class RunnerChoice:
    """What the plugin does about ``VLLM_USE_V2_MODEL_RUNNER``: the value to set (None: leave the
    environment as it is), the log level and the message naming the reason."""

    set_env: str | None
    level: int
    message: str


def choose_model_runner(gpu_platform: str | None, user_value: str | None) -> RunnerChoice:
    """Decide from the platform (``gpu_platform``: ``"cuda"`` / ``"rocm"``, or None where vLLM has no V2
    runner, as on vLLM-CPU) and the user's ``VLLM_USE_V2_MODEL_RUNNER`` (None: unset)."""
    if gpu_platform is None:
        return RunnerChoice(None, logging.DEBUG, "no GPU platform: vLLM chooses its model runner")
    if user_value is None:
        return RunnerChoice(
            "0",
            logging.INFO,
            f"ATOM vLLM plugin selects vLLM's V1 GPU model runner on {gpu_platform} ({ENV}=0): the plugin's "
            "attention/GDN backends and MTP draft are written and tested against V1; Model Runner V2 is "
            f"untested with them. Set {ENV}=1 to run V2 anyway.",
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
    if wants_v2:
        return RunnerChoice(
            None,
            logging.WARNING,
            f"{ENV}={user_value} is set: vLLM runs Model Runner V2, which is untested with the ATOM vLLM "
            "plugin (its attention/GDN backends and MTP draft are tested with the V1 runner only). Unset it, "
            "or set 0, to run V1.",
        )
    return RunnerChoice(
        None,
        logging.INFO,
        f"ATOM vLLM plugin runs with vLLM's V1 GPU model runner on {gpu_platform} ({ENV}={user_value} in the "
        "environment; the plugin's backends and MTP draft are tested with V1 only)",
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


def pin_v1_model_runner(
    environ: MutableMapping[str, str] | None = None, platform: Any | None = None
) -> RunnerChoice:
    """Apply :func:`choose_model_runner` for vLLM's current platform to ``environ`` (``os.environ``) and log
    its one line; return the choice."""
    environ = os.environ if environ is None else environ
    platform = _current_platform() if platform is None else platform
    choice = choose_model_runner(gpu_platform_name(platform), environ.get(ENV))
    if choice.set_env is not None:
        environ[ENV] = choice.set_env
        if environ is os.environ:
            _check_vllm_sees(choice.set_env)
    logger.log(choice.level, "%s", choice.message)
    return choice


def _check_vllm_sees(value: str) -> None:
    """Warn where ``vllm.envs`` already cached its environment (the variable would then come too late)."""
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER is not bool(int(value)):
        logger.warning(
            "%s=%s was set after vLLM cached its environment; this process keeps %s=%s",
            ENV,
            value,
            ENV,
            envs.VLLM_USE_V2_MODEL_RUNNER,
        )
