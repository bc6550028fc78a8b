"""Make this directory's helpers importable (pytest runs with --import-mode=importlib, which does not put
test directories on sys.path): test_parallel.py reuses test_register_and_config.py's config fixture."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
