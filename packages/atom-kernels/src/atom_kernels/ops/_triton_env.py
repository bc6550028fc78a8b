"""How Triton runs here, for the ``triton`` backend and the Triton op modules (no Triton import)."""

from __future__ import annotations

import functools
import os


@functools.cache
def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (env ``TRITON_INTERPRET=1``); read once,
    like Triton itself, which decides when a kernel is decorated."""
    return os.environ.get("TRITON_INTERPRET") == "1"
