"""Shared helpers for the vLLM integration tests: fixture paths, prompt sets and cached engine runs.

Every vLLM engine start costs tens of seconds on the 2-core CI machine, so runs go through
:func:`engine_run`, which caches results per spec for the whole pytest session: test modules that need
the same configuration share one engine start. Runs happen in fresh processes
(:mod:`_harness`), because vLLM's ``LLM`` must be created under ``__main__``.
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from atom_core import testing


def model_dir() -> Path:
    return testing.model_dir()


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

_RUNS: dict[str, dict[str, Any]] = {}
_WORKDIR = Path(os.environ.get("ATOM_VLLM_TEST_WORKDIR", tempfile.mkdtemp(prefix="atom-vllm-tests-")))


def greedy_job() -> dict[str, Any]:
    cases = greedy_cases()
    return {"name": "greedy", "prompt_token_ids": [c["prompt_ids"] for c in cases], "max_tokens": 64}


def prompts_job() -> dict[str, Any]:
    prompts, max_tokens = prompt_set()
    return {"name": "prompts", "prompt_token_ids": prompts, "max_tokens": max_tokens}


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


def engine_run(s: dict[str, Any], name: str) -> dict[str, Any]:
    """Run ``s`` once per session (cached by its JSON); fail the test with the engine's error and log."""
    from _harness import run

    key = json.dumps(s, sort_keys=True)
    if key not in _RUNS:
        _RUNS[key] = run(s, str(_WORKDIR), timeout=900, log_name=name)
    result = _RUNS[key]
    if "error" in result:
        pytest.fail(
            f"vLLM run {name} failed: {result['error']}\n{result.get('traceback', result.get('log_tail', ''))[-3000:]}"
            f"\n(log: {result.get('log')})"
        )
    return result
