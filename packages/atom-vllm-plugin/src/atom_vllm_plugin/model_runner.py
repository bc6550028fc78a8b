"""Which vLLM GPU model runner serves the plugin's models: vLLM's own choice, with or without prefix caching.

vLLM 0.32 has two GPU model runners. ``VllmConfig.use_v2_model_runner`` (``vllm/config/vllm.py``) picks
Model Runner V2 (``vllm/v1/worker/gpu/``) wherever Triton is importable and no feature V2 lacks is asked
for, unless ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise; vLLM-CPU has no Triton and always runs V1 (its CPU
runner subclasses V1's GPU runner).

The plugin's metadata builders, GDN state and MTP draft run under both (measured on an H100 with the
bundled model, float32, full CUDA graphs, async scheduling: ``greedy.json`` exact at k = 1 and 3 with V1's
acceptance). V2 overlaps the next step's host work with the GPU's and captures the MTP draft in a full
graph, where V1 captures it only piecewise; at 80B-A3B width it runs the concurrency-1 decode step 1.6x
faster (``docs/performance.md``). Prefix caching (vLLM's Mamba "align" mode) is served by both: under V1
the plugin wraps the runner's align-mode state copies (``patches.mamba_align``), under V2 the target
supplies its own model state (``get_model_state_cls``, :mod:`atom_vllm_plugin.model_state`), which
replaces vLLM's align-mode copies with whole-slot copies of the plugin's deferred-commit GDN state
planned on the device.

So the plugin does not set ``VLLM_USE_V2_MODEL_RUNNER``: :func:`select_model_runner` (called from the
target's config hook, :mod:`atom_vllm_plugin.config_hook`) only logs which runner vLLM will use and why, a
user's own value of the variable included. Features that only V2 has (HiSparse, watermarking) make vLLM
pick V2 whatever the variable says.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.atom_vllm_plugin")

ENV = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's switch between its GPU model runners (unset: vLLM decides; ``0``: V1; ``1``: V2)."""


@dataclass(frozen=True)
class RunnerChoice:
    """What the plugin reports about the model runner: the log level and the message."""

    level: int
    message: str


def choose_model_runner(
    gpu_platform: str | None, user_value: str | None, prefix_caching: bool
) -> RunnerChoice:
    """The report for the platform (``gpu_platform``: ``"cuda"`` / ``"rocm"``, or None where vLLM has no V2
    runner, as on vLLM-CPU), the user's ``VLLM_USE_V2_MODEL_RUNNER`` (None: unset) and whether the config
    has prefix caching on. The plugin serves every combination; nothing is refused or overridden."""
    if gpu_platform is None:
        return RunnerChoice(logging.DEBUG, "no GPU platform: vLLM chooses its model runner")
    caching = (
        "prefix caching on (the plugin's GDN snapshot copies for either runner)"
        if prefix_caching
        else "prefix caching off"
    )
    if user_value is None:
        return RunnerChoice(
            logging.INFO,
            f"ATOM vLLM plugin runs with vLLM's choice of GPU model runner on {gpu_platform} (Model Runner V2 "
            f"unless a feature it lacks is asked for; {ENV}=0 selects V1), {caching}",
        )
    try:
        wants_v2 = bool(int(user_value))
    except ValueError:
        return RunnerChoice(
            logging.WARNING,
            f"{ENV}={user_value!r} is not an integer (vLLM reads it with int()); the ATOM vLLM plugin leaves it "
            "as it is",
        )
    runner = "Model Runner V2" if wants_v2 else "the V1 GPU model runner"
    return RunnerChoice(
        logging.INFO, f"ATOM vLLM plugin runs with {runner} on {gpu_platform} ({ENV}={user_value}), {caching}"
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
    prefix_caching: bool, environ: Mapping[str, str] | None = None, platform: Any | None = None
) -> RunnerChoice:
    """Log :func:`choose_model_runner` for vLLM's current platform and ``environ`` (``os.environ``, read
    only) in one line; return it."""
    environ = os.environ if environ is None else environ
    platform = _current_platform() if platform is None else platform
    choice = choose_model_runner(gpu_platform_name(platform), environ.get(ENV), prefix_caching)
    logger.log(choice.level, "%s", choice.message)
    return choice
