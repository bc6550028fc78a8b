#!/usr/bin/env bash
# Main job: set up, then serve the bundled tiny Qwen3-Next with MTP (k=1) through vLLM in plugin mode,
# show a completion and the acceptance figures. Arguments go to scripts/serve_demo.py (e.g. --k 3).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
uv run --no-sync python scripts/serve_demo.py "$@"
