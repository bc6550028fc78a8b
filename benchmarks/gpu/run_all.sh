#!/usr/bin/env bash
# One batch of GPU work in one command: ceilings, the atom-kernels conformance tests on the GPU for every
# available backend, then the benchmark scripts; everything lands in $OUT (or --out DIR).
#
# Usage (from the repository root, on the GPU machine):
#   benchmarks/gpu/run_all.sh [--out DIR] [--no-tests] [--no-bench] [-k PYTEST_EXPR] [--tests PATH]...
#                             [--bench-args "ARGS"] [--jobs N] [SCRIPT ...]
#   SCRIPT: benchmark scripts in benchmarks/gpu (e.g. bench_gdn.py); default: every bench_*.py there.
#   -k / --tests narrow the conformance run (default: all of packages/atom-kernels/tests).
#   --bench-args is passed to every benchmark script (e.g. "--quick").
#   --jobs N runs the conformance tests in N processes (pytest-xdist, brought as a wheel in .whl/): the
#   suite is mostly Triton compiles, which are CPU-bound and run in parallel.
# Typical device call (device tool), carrying the fla-core wheel:
#   set -o pipefail; benchmarks/gpu/run_all.sh bench_gdn.py 2>&1 | tee $OUT/log
# Exit status: non-zero if the tests or any benchmark failed (all of them still run).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUTDIR=${OUT:-$ROOT/benchmarks/results/local}
RUN_TESTS=1
RUN_BENCH=1
PYTEST_K=""
TEST_PATHS=()
BENCH_ARGS=""
JOBS=""
SCRIPTS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) OUTDIR=$2; shift 2 ;;
        --no-tests) RUN_TESTS=0; shift ;;
        --no-bench) RUN_BENCH=0; shift ;;
        -k) PYTEST_K=$2; shift 2 ;;
        --tests) TEST_PATHS+=("$2"); shift 2 ;;
        --bench-args) BENCH_ARGS=$2; shift 2 ;;
        --jobs) JOBS=$2; shift 2 ;;
        -h|--help) sed -n 2,15p "$0"; exit 0 ;;
        -*) echo "run_all.sh: unknown option $1" >&2; exit 2 ;;
        *) SCRIPTS+=("$1"); shift ;;
    esac
done
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

# Pure-python wheels brought along (fla-core): install into a private target, never into the image.
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$ROOT"/.whl/*.whl || { echo "run_all.sh: wheel install failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT/packages/atom-core/src:$ROOT/packages/atom-kernels/src${PYTHONPATH:+:$PYTHONPATH}
# Conformance tests pick the device from this variable (packages/atom-kernels/tests/conftest.py).
export ATOM_KERNELS_TEST_DEVICE=${ATOM_KERNELS_TEST_DEVICE:-cuda}

"$PY" - <<'EOF'
import torch, triton
print(f"torch {torch.__version__} triton {triton.__version__} cuda={torch.cuda.is_available()}",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
try:
    import fla; print("fla-core", fla.__version__)
except ImportError:
    print("fla-core: not installed")
EOF

STATUS=0
echo "=== ceilings"
"$PY" benchmarks/gpu/common.py --out "$OUTDIR" || STATUS=1

if [[ $RUN_TESTS == 1 ]]; then
    echo "=== conformance tests (ATOM_KERNELS_TEST_DEVICE=$ATOM_KERNELS_TEST_DEVICE)"
    [[ ${#TEST_PATHS[@]} -eq 0 ]] && TEST_PATHS=(packages/atom-kernels/tests)
    K_ARGS=()
    [[ -n $PYTEST_K ]] && K_ARGS=(-k "$PYTEST_K")
    [[ -n $JOBS ]] && K_ARGS+=(-n "$JOBS")
    "$PY" -m pytest -q -p no:cacheprovider -rs --durations=10 "${K_ARGS[@]}" "${TEST_PATHS[@]}" || STATUS=1
fi

if [[ $RUN_BENCH == 1 ]]; then
    if [[ ${#SCRIPTS[@]} -eq 0 ]]; then
        for f in benchmarks/gpu/bench_*.py; do SCRIPTS+=("$(basename "$f")"); done
    fi
    for s in "${SCRIPTS[@]}"; do
        echo "=== $s"
        # shellcheck disable=SC2086
        "$PY" "benchmarks/gpu/$s" --out "$OUTDIR" $BENCH_ARGS || { echo "run_all.sh: $s failed"; STATUS=1; }
    done
fi
echo "=== run_all.sh done, status $STATUS; files in $OUTDIR:"
ls -la "$OUTDIR"
exit $STATUS
