"""Typed field access on a raw JSON-like mapping, raising :class:`ConfigError` with field, value, source."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from atom_core.errors import MISSING, ConfigError


class FieldReader:
    """Reads fields of one mapping; every error names ``prefix + field``, the value and ``source``."""

    def __init__(self, raw: Mapping[str, Any], source: str, prefix: str = "") -> None:
        if not isinstance(raw, Mapping):
            raise ConfigError(prefix.rstrip(".") or "<root>", raw, source, "expected a JSON object")
        self.raw = raw
        self.source = source
        self.prefix = prefix

    def name(self, field: str) -> str:
        return self.prefix + field

    def fail(self, field: str, value: Any, problem: str) -> ConfigError:
        return ConfigError(self.name(field), value, self.source, problem)

    def get(self, field: str, default: Any = MISSING) -> Any:
        value = self.raw.get(field, MISSING)
        if value is MISSING:
            if default is MISSING:
                raise self.fail(field, "<missing>", "required field is missing")
            return default
        return value

    def int(self, field: str, default: Any = MISSING, *, minimum: int | None = None) -> int:
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, value, f"expected an integer, got {type(value).__name__}")
        if minimum is not None and value < minimum:
            raise self.fail(field, value, f"must be >= {minimum}")
        return value

    def float(self, field: str, default: Any = MISSING, *, positive: bool = False) -> float:
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(field, value, f"expected a number, got {type(value).__name__}")
        if positive and not value > 0:
            raise self.fail(field, value, "must be > 0")
        return float(value)

    def bool(self, field: str, default: Any = MISSING) -> bool:
        value = self.get(field, default)
        if not isinstance(value, bool):
            raise self.fail(field, value, f"expected true or false, got {type(value).__name__}")
        return value

    def str(self, field: str, default: Any = MISSING, *, choices: Sequence[str] | None = None) -> str:
        value = self.get(field, default)
        if not isinstance(value, str):
            raise self.fail(field, value, f"expected a string, got {type(value).__name__}")
        if choices is not None and value not in choices:
            raise self.fail(field, value, f"must be one of {list(choices)}")
        return value

    def int_list(self, field: str, default: Any = MISSING) -> tuple[int, ...]:
        value = self.get(field, default)
        if not isinstance(value, list | tuple) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in value
        ):
            raise self.fail(field, value, "expected a list of integers")
        return tuple(value)

    def str_list(self, field: str, default: Any = MISSING) -> tuple[str, ...]:
        value = self.get(field, default)
        if not isinstance(value, list | tuple) or any(not isinstance(v, str) for v in value):
            raise self.fail(field, value, "expected a list of strings")
        return tuple(value)

    def sub(self, field: str) -> FieldReader | None:
        value = self.get(field, None)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self.fail(field, value, "expected a JSON object")
        return FieldReader(value, self.source, self.name(field) + ".")
