"""Per-shape launch configs of the FP8 one-launch decode linear, for ``plan(..., table=...)``.

A table maps ``(N, K, ROWS)`` (weight rows, weight columns, the one-launch kernel's power-of-two token
rows ``max(2, 2^ceil(log2 M))``) to the keys of the one-launch plan that replace the heuristic's for that
shape: ``BLOCK_N``, ``SPLIT_K``, ``SWAP_AB``, ``num_warps``, ``num_stages``, and ``ONE_LAUNCH`` (True: the
one-launch plan even above ``ONE_LAUNCH_MAX_M``; False alone: the three-launch plan). The table is plain
data passed by the caller; nothing here is global. ``benchmarks/gpu/tune_decode.py`` writes its measured
best configs as a ``decode_table`` list of ``{"n", "k", "rows", "config", ...}`` entries, which
:func:`load_decode_table` reads (other keys of an entry, e.g. its timings, are ignored).

Measured tables ship beside this module in ``decode_tables/<device name>.json`` (the name CUDA reports,
spaces as underscores, e.g. ``NVIDIA_H100_80GB_HBM3.json``); :func:`tuned_table` returns the one of a
device, or an empty table (the heuristic) for a device without one.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

TABLES_DIR = Path(__file__).resolve().parent / "decode_tables"
EMPTY: Mapping[tuple[int, int, int], Mapping] = MappingProxyType({})

TABLE_KEYS = frozenset({"ONE_LAUNCH", "BLOCK_N", "SPLIT_K", "SWAP_AB", "num_warps", "num_stages"})
"""Keys a table entry may set (the one-launch plan's, less ``ROWS``, which is part of the table key)."""


def _positive_int(name: str, value, key) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"fp8 decode table {key}: {name} must be a positive int, got {value!r}")
    return value


def _entry(key: tuple[int, int, int], config: Mapping) -> Mapping:
    unknown = set(config) - TABLE_KEYS
    if unknown:
        raise ValueError(
            f"fp8 decode table {key}: unknown keys {sorted(unknown)} (allowed: {sorted(TABLE_KEYS)})"
        )
    cfg = dict(config)
    if cfg.get("ONE_LAUNCH") is False and len(cfg) > 1:
        raise ValueError(f"fp8 decode table {key}: ONE_LAUNCH=False takes no other keys, got {sorted(cfg)}")
    for name in ("ONE_LAUNCH", "SWAP_AB"):
        if name in cfg and not isinstance(cfg[name], bool):
            raise ValueError(f"fp8 decode table {key}: {name} must be a bool, got {cfg[name]!r}")
    for name in ("BLOCK_N", "SPLIT_K", "num_warps", "num_stages"):
        if name in cfg:
            _positive_int(name, cfg[name], key)
    for name in ("BLOCK_N", "num_warps"):
        if name in cfg and cfg[name] & (cfg[name] - 1):
            raise ValueError(f"fp8 decode table {key}: {name} must be a power of two, got {cfg[name]}")
    return MappingProxyType(cfg)


def decode_table(entries: Iterable[Mapping]) -> Mapping[tuple[int, int, int], Mapping]:
    """``{(n, k, rows): config}`` (read-only) from entries ``{"n", "k", "rows", "config"}``; a key given
    twice, a ``rows`` that is not a power of two >= 2, or a config key outside ``TABLE_KEYS`` raises."""
    table: dict[tuple[int, int, int], Mapping] = {}
    for e in entries:
        key = tuple(_positive_int(name, e[name], e) for name in ("n", "k", "rows"))
        if key[2] < 2 or key[2] & (key[2] - 1):
            raise ValueError(f"fp8 decode table {key}: rows must be a power of two >= 2")
        if key in table:
            raise ValueError(f"fp8 decode table: (n, k, rows) = {key} given twice")
        table[key] = _entry(key, e["config"])
    return MappingProxyType(table)


def load_decode_table(path: str | Path) -> Mapping[tuple[int, int, int], Mapping]:
    """:func:`decode_table` of a JSON file: a list of entries, or an object with a ``decode_table`` list
    (the result file of ``benchmarks/gpu/tune_decode.py``)."""
    data = json.loads(Path(path).read_text())
    entries = data["decode_table"] if isinstance(data, dict) else data
    return decode_table(entries)


def table_path(device_name: str) -> Path:
    """Where the shipped table of the device named ``device_name`` lives (it may not exist)."""
    return TABLES_DIR / f"{device_name.strip().replace(' ', '_')}.json"


@functools.cache
def tuned_table(device_name: str) -> Mapping[tuple[int, int, int], Mapping]:
    """The shipped table of ``device_name`` (:func:`table_path`), read once; :data:`EMPTY` where none
    ships. A shipped file that does not parse or validate raises, naming the file."""
    path = table_path(device_name)
    if not path.is_file():
        return EMPTY
    try:
        return load_decode_table(path)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"fp8 decode table {path}: {err}") from err
