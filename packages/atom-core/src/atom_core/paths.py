"""Where the bundled tiny checkpoint and its reference outputs live (for the CLI default, tests, benchmarks).

Searched from the current directory and its parents, and from this file's parents that look like a
checkout: ``<repo>/data/<name>`` first, then ``<repo>/../shared/fixtures/<name>``.
"""

from __future__ import annotations

from pathlib import Path

MODEL_NAME = "tiny-qwen3-next-mtp"
REFERENCE_NAME = f"{MODEL_NAME}-reference"


def _roots() -> list[Path]:
    here = Path(__file__).resolve()
    roots = [Path.cwd(), *Path.cwd().parents]
    roots += [p for p in here.parents if (p / "data").is_dir() or (p / "packages").is_dir()]
    return roots


def find_fixture(name: str, marker: str) -> Path | None:
    """The first ``data/<name>`` or ``../shared/fixtures/<name>`` holding ``marker``, or None."""
    roots = _roots()
    for cand in [r / "data" / name for r in roots] + [r.parent / "shared" / "fixtures" / name for r in roots]:
        if (cand / marker).is_file():
            return cand
    return None


def default_model_dir() -> Path:
    """The tiny Qwen3-Next + MTP checkpoint (``config.json`` and safetensors); FileNotFoundError if absent."""
    found = find_fixture(MODEL_NAME, "config.json")
    if found is None:
        raise FileNotFoundError(f"no {MODEL_NAME} in data/ of the repository or in ../shared/fixtures/")
    return found


def reference_dir() -> Path:
    """Its float32 reference outputs (``golden.safetensors``, ``greedy.json``, ``prompts.json``);
    FileNotFoundError if absent."""
    found = find_fixture(REFERENCE_NAME, "greedy.json")
    if found is None:
        raise FileNotFoundError(f"no {REFERENCE_NAME} in data/ of the repository or in ../shared/fixtures/")
    return found
