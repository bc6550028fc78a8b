"""Stop tokens from a checkpoint's ``generation_config.json`` (vLLM stops on its ``eos_token_id`` too).

Qwen3-Next-Instruct's config.json has ``eos_token_id: 151645`` while generation_config.json lists
``[151645, 151643]``; the engine stops on the union, like vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from atom_core import ConfigError, Qwen3NextConfig

GENERATION_CONFIG = "generation_config.json"


def generation_eos_ids(ckpt_dir: str | os.PathLike[str]) -> tuple[int, ...]:
    """``eos_token_id`` of ``<ckpt_dir>/generation_config.json`` (an int or a list of ints), ``()`` when the
    file or the field is absent. Anything else (``true``, a string, a negative id) raises ConfigError."""
    path = Path(ckpt_dir) / GENERATION_CONFIG
    if not path.is_file():
        return ()
    source = str(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError("<file>", source, source, f"not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError("<root>", type(raw).__name__, source, "expected a JSON object at top level")
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ids):
        raise ConfigError("eos_token_id", eos, source, "expected a token id (int >= 0) or a list of them")
    return tuple(ids)


def with_generation_eos(config: Qwen3NextConfig, ckpt_dir: str | os.PathLike[str]) -> Qwen3NextConfig:
    """``config`` whose ``eos_token_id`` is the union of config.json's and generation_config.json's."""
    extra = generation_eos_ids(ckpt_dir)
    bad = [t for t in extra if t >= config.vocab_size]
    if bad:
        source = str(Path(ckpt_dir) / GENERATION_CONFIG)
        raise ConfigError("eos_token_id", bad, source, f"token ids must be < vocab_size {config.vocab_size}")
    union = tuple(dict.fromkeys((*config.eos_token_id, *extra)))
    return config if union == config.eos_token_id else dataclasses.replace(config, eos_token_id=union)
