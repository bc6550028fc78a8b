"""Where the bundled tiny checkpoint lives: the repo's ``data/`` folder, else ``../shared/fixtures``."""

from __future__ import annotations

from pathlib import Path

MODEL_NAME = "tiny-qwen3-next-mtp"


def _roots() -> list[Path]:
    here = Path(__file__).resolve()
    roots = [Path.cwd(), *Path.cwd().parents]
    roots += [p for p in here.parents if (p / "data").is_dir() or (p / "packages").is_dir()]
    return roots


def default_model_dir() -> Path:
    """``<repo>/data/tiny-qwen3-next-mtp``, falling back to ``<repo>/../shared/fixtures/tiny-qwen3-next-mtp``."""
    roots = _roots()
    for root in roots:
        cand = root / "data" / MODEL_NAME
        if (cand / "config.json").is_file():
            return cand
    for root in roots:
        cand = root.parent / "shared" / "fixtures" / MODEL_NAME
        if (cand / "config.json").is_file():
            return cand
    raise FileNotFoundError(
        f"no {MODEL_NAME} found in data/ of the repository or in ../shared/fixtures/; pass --model DIR"
    )


def reference_dir() -> Path:
    """``../shared/fixtures/tiny-qwen3-next-mtp-reference`` (float32 transformers outputs)."""
    for root in _roots():
        for cand in (
            root / "data" / f"{MODEL_NAME}-reference",
            root.parent / "shared" / "fixtures" / f"{MODEL_NAME}-reference",
        ):
            if (cand / "golden.safetensors").is_file():
                return cand
    raise FileNotFoundError(f"{MODEL_NAME}-reference not found in data/ or ../shared/fixtures/")
