"""The one error type atom-core raises for bad configuration input."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration field is missing, wrongly typed or out of range.

    The message always names the field, the offending value and where it came from (a file path,
    ``<dict>`` for an in-memory mapping, or ``env`` for an environment variable).
    """

    def __init__(self, field: str, value: Any, source: str, problem: str) -> None:
        self.field = field
        self.value = value
        self.source = source
        self.problem = problem
        super().__init__(f"{source}: field {field!r} = {value!r}: {problem}")


MISSING = object()
"""Sentinel for a field that is absent from the input mapping."""
