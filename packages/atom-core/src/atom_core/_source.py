"""Turn ``path_or_dict`` into a raw mapping plus a source name for error messages."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from atom_core.errors import ConfigError


def load_raw(
    path_or_dict: str | os.PathLike[str] | Mapping[str, Any], source: str | None = None
) -> tuple[Mapping[str, Any], str]:
    """Return ``(mapping, source)``. A directory means its ``config.json``; a mapping's source is ``source``
    (where it was read from, for error messages) or ``<dict>``."""
    if isinstance(path_or_dict, Mapping):
        return path_or_dict, source or "<dict>"
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError("<file>", path, path, "config file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError("<file>", path, path, f"not valid JSON ({e})") from None
    if not isinstance(raw, Mapping):
        raise ConfigError("<root>", type(raw).__name__, path, "expected a JSON object at top level")
    return raw, path
