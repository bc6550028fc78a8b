"""One pass over each slot's float32 GDN state, in C: the state part of the cpu backend's decode and verify.

For every real row ``n`` (``slots[n] >= 0``), value head ``h`` and state row ``i`` (``Dk`` floats), in
place in the pool::

    S[i] = decay[n, h] S[i] + sum_l uw[n, h, i, l] kk[n, h, l]      (when an update is given)
    sx[n, h, i, c] = S[i] . x[n, h, c]                              (when products are asked)

so each state row is read once, written at most once and dotted with the ``C`` token vectors while it is
in registers; padding rows (``slots[n] < 0``) get ``sx = 0`` and touch nothing. The torch forms of the same
step (a per-slot ``mul_`` / ``baddbmm_`` / ``matmul``, or an inductor-compiled gather / update / scatter)
pass over the state three times; this is the memory-bound minimum. Same float32 math as them up to the
order of the sums (16 lanes, then a fixed lane order); no fast-math flag (nothing changes the process's
floating-point mode).

The source is compiled once per machine with the system C compiler (``cc``, or ``$CC``) into a cache
directory (``$ATOM_KERNELS_CACHE`` or ``~/.cache/atom_kernels``), the file named by a hash of the source,
the flags, the compiler's version and the CPU's flags, and loaded with :mod:`ctypes` (which releases the
GIL). Rows are split over ``torch.get_num_threads()`` OpenMP threads. Where no compiler works,
:func:`load` returns None and the backend keeps its torch forms.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

MAX_COLS = 16
"""Most product columns ``C`` one call takes (``2Q``: verify tokens' k and q)."""

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_COLS 16
typedef float vec __attribute__((vector_size(64)));              /* 16 floats: one AVX-512 register */
typedef float uvec __attribute__((vector_size(64), aligned(4)));  /* the same, at any float address */

static inline vec load(const float *p) { return *(const uvec *)p; }
static inline void store(float *p, vec v) { *(uvec *)p = v; }
static inline float lane_sum(vec v) {
    float s = 0.0f;
    for (int j = 0; j < LANES; ++j) s += v[j];
    return s;
}

/* One state row (dk floats): optional update, then its dot products with the c token vectors x. C is the
   number of columns when known at compile time (the accumulators then stay in registers), else 0 and c. */
#define ROW_PASS(NAME, C)                                                                                  \
static void NAME(float *restrict row, int64_t dk, float decay, const float *restrict uw,                   \
                 const float *restrict kk, int64_t r, const float *restrict x, int64_t c,                  \
                 float *restrict out) {                                                                    \
    const int64_t cols = C ? C : c;                                                                        \
    vec acc[C ? C : MAX_COLS];                                                                             \
    for (int64_t ci = 0; ci < cols; ++ci) acc[ci] = (vec){0};                                             \
    float tail[C ? C : MAX_COLS];                                                                          \
    for (int64_t ci = 0; ci < cols; ++ci) tail[ci] = 0.0f;                                                 \
    int64_t b = 0;                                                                                         \
    for (; b + LANES <= dk; b += LANES) {                                                                  \
        vec s = load(row + b);                                                                             \
        if (kk) {                                                                                          \
            vec t = (vec){0};                                                                              \
            for (int64_t l = 0; l < r; ++l) t += uw[l] * load(kk + l * dk + b);                            \
            s = s * decay + t;                                                                             \
            store(row + b, s);                                                                             \
        }                                                                                                  \
        for (int64_t ci = 0; ci < cols; ++ci) acc[ci] += s * load(x + ci * dk + b);                        \
    }                                                                                                      \
    for (; b < dk; ++b) {                                                                                  \
        float s = row[b];                                                                                  \
        if (kk) {                                                                                          \
            float t = 0.0f;                                                                                \
            for (int64_t l = 0; l < r; ++l) t += uw[l] * kk[l * dk + b];                                   \
            s = s * decay + t;                                                                             \
            row[b] = s;                                                                                    \
        }                                                                                                  \
        for (int64_t ci = 0; ci < cols; ++ci) tail[ci] += s * x[ci * dk + b];                              \
    }                                                                                                      \
    for (int64_t ci = 0; ci < cols; ++ci) out[ci] = lane_sum(acc[ci]) + tail[ci];                          \
}

ROW_PASS(row_any, 0)
ROW_PASS(row_c2, 2)
ROW_PASS(row_c4, 4)
ROW_PASS(row_c6, 6)
ROW_PASS(row_c8, 8)

typedef void (*row_fn)(float *, int64_t, float, const float *, const float *, int64_t, const float *,
                       int64_t, float *);

void gdn_state_pass(float *pool, int64_t slot_stride, const int64_t *slots, int64_t n, int64_t hv,
                    int64_t dv, int64_t dk, const float *decay, const float *uw, const float *kk,
                    int64_t r, const float *x, int64_t c, float *sx, int nthreads) {
    const int64_t jobs = n * hv;
    const row_fn pass = c == 2 ? row_c2 : c == 4 ? row_c4 : c == 6 ? row_c6 : c == 8 ? row_c8 : row_any;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t job = 0; job < jobs; ++job) {
        const int64_t i = job / hv, h = job % hv;
        const int64_t slot = slots[i];
        float *out = sx ? sx + job * dv * c : 0;
        if (slot < 0) {
            if (out) memset(out, 0, sizeof(float) * dv * c);
            continue;
        }
        float *state = pool + slot * slot_stride + h * dv * dk;
        const float d = decay ? decay[job] : 1.0f;
        const float *kh = kk ? kk + job * r * dk : 0;
        const float *xh = x ? x + job * c * dk : 0;
        for (int64_t row = 0; row < dv; ++row) {
            pass(state + row * dk, dk, d, kh ? uw + (job * dv + row) * r : 0, kh, r, xh, out ? c : 0,
                 out ? out + row * c : 0);
        }
    }
}
"""

_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=gnu99")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _compile(compiler: str, cache: Path) -> Path | None:
    """The shared library for this source, compiler and CPU (built now if not cached), or None."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256("\0".join((_SOURCE, *_FLAGS, version, _cpu_flags())).encode()).hexdigest()[:24]
    lib = cache / f"gdn_state_pass_{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, out = Path(tmp) / "gdn_state_pass.c", Path(tmp) / "lib.so"
        src.write_text(_SOURCE)
        try:
            done = subprocess.run(
                [compiler, *_FLAGS, str(src), "-o", str(out)], capture_output=True, timeout=300
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if done.returncode != 0:
            return None
        os.replace(out, lib)  # atomic: concurrent builders of the same key write the same bytes
    return lib


@functools.cache
def load():
    """The compiled ``gdn_state_pass`` function, or None where no C compiler builds it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    cache = Path(os.environ.get("ATOM_KERNELS_CACHE") or Path.home() / ".cache" / "atom_kernels")
    lib = _compile(compiler, cache)
    if lib is None:
        return None
    fn = ctypes.CDLL(str(lib)).gdn_state_pass
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, ctypes.c_int]
    fn.restype = None
    return fn


def usable(ssm_state: torch.Tensor, cols: int) -> bool:
    """Whether :func:`state_pass` takes this pool and ``cols`` product columns: float32, each slot's state
    contiguous, ``cols <= MAX_COLS``, a C build."""
    if (
        cols > MAX_COLS
        or ssm_state.dtype != torch.float32
        or ssm_state.shape[0] == 0
        or not ssm_state[0].is_contiguous()
    ):
        return False
    return load() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def state_pass(
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    decay: torch.Tensor | None = None,
    uw: torch.Tensor | None = None,
    kk: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """In place on the float32 pool ``ssm_state [S, Hv, Dv, Dk]`` (:func:`usable`), for each real row of
    ``slots`` (int64 ``[N]``): given ``decay [N, Hv]``, ``uw [N, Hv, Dv, R]``, ``kk [N, Hv, R, Dk]``, the
    update ``S = decay S + uw kk``; then, given ``x [N, Hv, C, Dk]`` (``C <= MAX_COLS``), returns the products
    ``S x^T`` ``[N, Hv, Dv, C]`` of the (updated) state (zeros on padding rows), else None."""
    fn = load()
    num_seqs = slots.shape[0]
    _, hv, dv, dk = ssm_state.shape
    slots = slots.contiguous()
    if decay is not None:
        decay, uw, kk = decay.float().contiguous(), uw.float().contiguous(), kk.float().contiguous()
    r = 0 if kk is None else kk.shape[2]
    sx, c = None, 0
    if x is not None:
        x = x.float().contiguous()
        c = x.shape[2]
        if c > MAX_COLS:
            raise ValueError(f"state_pass takes at most {MAX_COLS} product columns, got {c}")
        sx = torch.empty(num_seqs, hv, dv, c, dtype=torch.float32, device=ssm_state.device)
    if num_seqs:
        fn(
            ssm_state.data_ptr(), ssm_state.stride(0), slots.data_ptr(), num_seqs, hv, dv, dk,
            _ptr(decay), _ptr(uw), _ptr(kk), r, _ptr(x), c, _ptr(sx), torch.get_num_threads(),
        )  # fmt: skip
    return sx
