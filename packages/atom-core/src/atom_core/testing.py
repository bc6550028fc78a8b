"""For the packages' tests: a missing oracle skips the test, or fails it under ``ATOM_REQUIRE_ORACLES=1``.

An oracle is what a test checks against and an environment may lack: the bundled model and its float32
reference outputs in ``data/`` (:mod:`atom_core.paths`), transformers (the float32 reference
implementation), vLLM. Every such test goes through these helpers, so that CI (``scripts/test.sh`` sets
``ATOM_REQUIRE_ORACLES=1``) cannot pass by skipping them. Skips for a missing GPU are not oracle skips.

Standard library only: a skip is :class:`unittest.SkipTest`, which pytest reports as a skip (in a test,
a fixture or at module level); a failure is :class:`MissingOracle`.
"""

from __future__ import annotations

import importlib
import unittest
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from atom_core import envs, paths


class MissingOracle(AssertionError):
    """An oracle is missing while ``ATOM_REQUIRE_ORACLES=1``: the test fails."""


def missing_oracle(reason: str) -> NoReturn:
    """Skip the calling test (or test module) because ``reason``; fail it instead when oracles are required."""
    if envs.oracles_required():
        raise MissingOracle(f"missing oracle: {reason} ({envs.ATOM_REQUIRE_ORACLES.name}=1)")
    raise unittest.SkipTest(f"missing oracle: {reason}")


def import_oracle(module: str, what: str | None = None) -> ModuleType:
    """``import_module(module)``; an ImportError makes it a missing oracle (described as ``what``)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing_oracle(f"{what or module} is not importable ({exc})")


def model_dir() -> Path:
    """:func:`atom_core.paths.default_model_dir`, or a missing oracle."""
    try:
        return paths.default_model_dir()
    except FileNotFoundError as exc:
        missing_oracle(str(exc))


def reference_dir() -> Path:
    """:func:`atom_core.paths.reference_dir`, or a missing oracle."""
    try:
        return paths.reference_dir()
    except FileNotFoundError as exc:
        missing_oracle(str(exc))


def reference_file(name: str) -> Path:
    """``name`` (``golden.safetensors``, ``greedy.json``, ``prompts.json``) in :func:`reference_dir`, or a
    missing oracle naming that file."""
    path = reference_dir() / name
    if not path.is_file():
        missing_oracle(f"missing {path}")
    return path
