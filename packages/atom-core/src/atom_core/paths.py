"""Where the bundled tiny checkpoint and its reference outputs live (for the CLI default, tests, benchmarks).

Both are in the repository's ``data/`` directory. The repository is the directory named by
``ATOM_DATA_ROOT`` if set (``atom_core.envs``; for a wheel installed outside the checkout), else the first
checkout (a directory holding ``data/`` and ``packages/atom-core/``) among the current directory, its parents, and
the parents of this file (an editable install).
"""

from __future__ import annotations

from pathlib import Path

from atom_core import envs

MODEL_NAME = "tiny-qwen3-next-mtp"
REFERENCE_NAME = f"{MODEL_NAME}-reference"


def repo_root() -> Path | None:
    """The checkout whose ``data/`` holds the fixtures, or None when none is found."""
    forced = envs.data_root()
    if forced is not None:
        return forced
    cwd = Path.cwd().resolve()
    for cand in [cwd, *cwd.parents, *Path(__file__).resolve().parents]:
        if (cand / "data").is_dir() and (cand / "packages" / "atom-core").is_dir():
            return cand
    return None


def find_fixture(name: str, marker: str) -> Path:
    """``<repo>/data/<name>``, which must hold ``marker``; FileNotFoundError naming the missing file."""
    root = repo_root()
    if root is None:
        raise FileNotFoundError(
            f"no repository checkout (a directory with data/ and packages/atom-core/) at or above {Path.cwd()} or "
            f"{Path(__file__).resolve().parent}, so no data/{name}/{marker}; set {envs.ATOM_DATA_ROOT.name}"
        )
    path = root / "data" / name / marker
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}")
    return path.parent


def default_model_dir() -> Path:
    """The tiny Qwen3-Next + MTP checkpoint (``config.json`` and safetensors); FileNotFoundError if absent."""
    return find_fixture(MODEL_NAME, "config.json")


def reference_dir() -> Path:
    """Its float32 reference outputs (``golden.safetensors``, ``greedy.json``, ``prompts.json``,
    ``inputs.json``; ``scripts/make_reference.py``); FileNotFoundError if absent."""
    return find_fixture(REFERENCE_NAME, "greedy.json")
