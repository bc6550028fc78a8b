#!/usr/bin/env bash
# Set up, then run every check CI runs: ruff (lint + format), import-linter layering contracts, and the
# tests of all four packages plus the vLLM integration tests. Exits non-zero when anything fails.
# Extra arguments go to pytest (e.g. scripts/test.sh -k mtp).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "[test] ruff"
uv run --no-sync ruff check .
uv run --no-sync ruff format --check .
echo "[test] import-linter"
uv run --no-sync lint-imports
echo "[test] pytest"
# testpaths in pyproject.toml: every package's tests/ and the top-level tests/.
uv run --no-sync pytest "$@"
