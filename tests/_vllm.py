"""Shared helpers for the vLLM integration tests: fixture paths, prompt sets and the session's engine runs.

Every vLLM engine start costs a minute or more on the 2-core CI machine, so each configuration is one named
run (:func:`plan`), started once per session and read by every test that checks it (:func:`engine_run`),
whatever module the test is in; runs are started ahead of their tests, two at a time (:mod:`_runs`). Runs
happen in fresh processes (:mod:`_harness`), because vLLM's ``LLM`` must be created under ``__main__``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from _runs import RUNS, Lanes
from _server import ServerError, VllmServer
from atom_core import testing


def model_dir() -> Path:
    return testing.model_dir()


@contextmanager
def plugin_server(
    args: Sequence[str], log: Path, ranks: int = 1, timeout: float = 900.0
) -> Iterator[VllmServer]:
    """vLLM's OpenAI server of the bundled model with the plugin, on ``ranks`` CPU lanes of its own (held
    beside the planned runs, ``_runs.py``; engine rank r on the r-th); a server that does not come up fails
    the test with its error."""
    with RUNS.lanes.hold(ranks) as cores:
        try:
            with VllmServer(
                model_dir(), args, plugin=True, log=log, env=Lanes.bind_env(cores, ranks), timeout=timeout
            ) as srv:
                yield srv
        except ServerError as e:
            pytest.fail(str(e))


@cache
def greedy_cases() -> list[dict[str, Any]]:
    """greedy.json: 8 prompts of 48 tokens with their 64-token float32 greedy continuations."""
    return json.loads(testing.reference_file("greedy.json").read_text())["cases"]


def greedy_differences(tokens: list[list[int]]) -> list[str]:
    """Where each output first leaves its greedy.json continuation; an output count other than the number
    of greedy.json prompts is a difference too (an empty result must not pass)."""
    cases = greedy_cases()
    if len(tokens) != len(cases):
        return [f"{len(tokens)} outputs for {len(cases)} greedy.json prompts"]
    bad = []
    for i, (got, case) in enumerate(zip(tokens, cases)):
        want = case["greedy_ids"]
        if got != want:
            j = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            bad.append(
                f"case {i}: first difference at token {j}: got {got[j : j + 4]}, want {want[j : j + 4]}"
            )
    return bad


@cache
def prompt_set() -> tuple[list[list[int]], int]:
    """prompts.json: (16 prompts of 64 tokens, max_tokens=128)."""
    raw = json.loads(testing.reference_file("prompts.json").read_text())
    return [p["prompt_token_ids"] for p in raw["prompts"]], int(raw["max_tokens"])


def vllm_available() -> bool:
    try:
        import atom_vllm_plugin  # noqa: F401  (raises ImportError without a supported vLLM)
    except ImportError:
        return False
    return True


requires_vllm = pytest.mark.usefixtures("vllm_oracle")
"""Mark of the tests that start vLLM: the ``vllm_oracle`` fixture (conftest.py) skips them without vLLM, or
fails them under ``ATOM_REQUIRE_ORACLES=1`` (atom_core.testing)."""


def vllm_runs(*names: str) -> pytest.MarkDecorator:
    """Mark: the planned runs a test reads (``{param}`` fields filled from its parameters), started ahead."""
    return pytest.mark.vllm_runs(*names)


WORKDIR = RUNS.workdir
"""Where the engine runs write their specs, results and logs (``ATOM_VLLM_TEST_WORKDIR``, else a temp dir)."""


def plan(name: str, build: Callable[[], dict[str, Any]]) -> str:
    """Register engine run ``name`` for the session (:meth:`_runs.Runs.plan`); returns ``name``."""
    return RUNS.plan(name, build)


def greedy_job() -> dict[str, Any]:
    cases = greedy_cases()
    return {"name": "greedy", "prompt_token_ids": [c["prompt_ids"] for c in cases], "max_tokens": 64}


def prompts_job() -> dict[str, Any]:
    prompts, max_tokens = prompt_set()
    return {"name": "prompts", "prompt_token_ids": prompts, "max_tokens": max_tokens}


def per_prompt_jobs() -> list[dict[str, Any]]:
    """prompts.json one prompt a job (``p0``, ``p1``, ...): each prompt generated alone, with its own
    spec-decode counters."""
    prompts, max_tokens = prompt_set()
    return [
        {"name": f"p{i}", "prompt_token_ids": [p], "max_tokens": max_tokens} for i, p in enumerate(prompts)
    ]


def spec(
    *,
    plugin: bool,
    dtype: str,
    k: int,
    jobs: list[dict[str, Any]],
    enforce_eager: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    s: dict[str, Any] = {
        "model": str(model_dir()),
        "plugin": plugin,
        "dtype": dtype,
        "num_speculative_tokens": k,
        "enforce_eager": enforce_eager,
        "jobs": jobs,
    }
    s.update(extra)
    return s


def engine_result(name: str) -> dict[str, Any]:
    """The result of the planned run ``name``, an engine that failed included (its ``error`` key)."""
    return RUNS.result(name)


def engine_run(name: str) -> dict[str, Any]:
    """The result of the planned run ``name``; fails the test with the engine's error and log."""
    result = engine_result(name)
    if "error" in result:
        pytest.fail(
            f"vLLM run {name} failed: {result['error']}\n{result.get('traceback', result.get('log_tail', ''))[-3000:]}"
            f"\n(log: {result.get('log')})"
        )
    return result


# Configurations read by tests of several modules.
def _bf16_k1(plugin: bool, enforce_eager: bool) -> dict[str, Any]:
    """bf16, MTP k = 1 on prompts.json, all prompts in one batch and each alone (test_vllm_bf16_acceptance.py,
    test_vllm_modes.py); the plugin's eager engine also runs greedy.json, test_vllm_fp8.py's bf16-checkpoint
    baseline. Both sides keep float32 GDN states on every CPU: stock's default follows the CPU's ISA
    (float32 with AVX512-BF16, the bf16 model dtype without it), the plugin's is float32 on any CPU
    (``models/common.py``); on an AVX2 EPYC stock's bf16 states left 8-9 of 16 texts different from the
    plugin's and the free-running acceptance 2.4-5 points apart, with float32 on both 6-7 and 0.7-1.1."""
    jobs = [prompts_job(), *per_prompt_jobs()] + ([greedy_job()] if plugin and enforce_eager else [])
    return spec(plugin=plugin, dtype="bfloat16", k=1, jobs=jobs, enforce_eager=enforce_eager,
                llm_kwargs={"mamba_ssm_cache_dtype": "float32"})  # fmt: skip


for _impl in ("stock", "plugin"):
    for _tag in ("eager", "compiled"):
        plan(f"bf16_{_impl}_k1_{_tag}", lambda p=_impl == "plugin", e=_tag == "eager": _bf16_k1(p, e))
