"""The cpu backend's GDN decode and verify on a float32 state pool, one pass over each state row, in C.

The closed form of :mod:`~atom_kernels.ops.gated_delta_rule.cpu` is local to a state row: row ``i`` of
``S`` (``Dk`` floats, value channel ``i`` of head ``h``) together with the per-head scalars gives that
channel's outputs and update coefficients. So for each sequence ``n``, value head ``h`` and row ``i``::

    S_i = dc S_i + sum_{l < n_commit} cc_l pu_{l,i} pk_l          (verify: commit the pending tokens; store)
    sk_j = S_i . k_j,  sq_j = S_i . q_j                              (j < Q, the call's tokens)
    u_j = beta_j (v_{j,i} - ecum_j sk_j - sum_{l<j} A_{jl} u_l)
    o_j = ecum_j sq_j + sum_{l<=j} B_{jl} u_l
    S_i = ad S_i + sum_j ac_j u_j k_j                                (decode: advance past the tokens; store)
    pending u_{j,i} = u_j                                            (verify: the stash, after the commit's read)

with the per-head scalars (``dc``, ``cc``, ``ecum``, ``A``, ``B``, ``ad``, ``ac``: exponentials of the gate
cumsums and the tokens' ``k . k`` / ``k . q`` products) computed by the caller (in C by
:mod:`.cpu_native_verify`, else in torch); the outputs written as float32 or, given ``out16``, bf16. Each
row is read once, its products taken while it is in registers, and written at most once: the
memory-bound minimum for a step (the torch forms pass over the state three times, or gather and scatter copies of it). Padding rows
(``slot < 0``) run from a zero state and store nothing. Same float32 math as the torch forms up to the
order of the sums (16 lanes, then a fixed pairwise tree); no fast-math flag (nothing changes the process's
floating-point mode).

The source is compiled once per machine with the system C compiler (``$CC``, ``cc`` or ``gcc``) into a
cache directory (``$ATOM_KERNELS_CACHE`` or ``~/.cache/atom_kernels``), the file named by a hash of the
source, the flags, the compiler's version and the CPU's flags, and loaded with :mod:`ctypes` (which
releases the GIL; a call costs a few microseconds). The ``N * Hv`` heads are split over
``torch.get_num_threads()`` OpenMP threads. Where no compiler builds it, :func:`load` returns None and the
backend keeps its torch forms.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAX_TOKENS = 8
"""Most tokens ``Q`` of one call the C pass takes (longer calls take the torch forms)."""

VECTOR_PRELUDE = r"""
#ifdef __AVX512F__
#define LANES 16  /* one AVX-512 register */
#else
#define LANES 8   /* one AVX2 register: 16-float vectors spill and shuffle element by element there */
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));
typedef float uvec __attribute__((vector_size(4 * LANES), aligned(4)));  /* the same at any float address */
typedef uint16_t bvec __attribute__((vector_size(2 * LANES), aligned(2)));  /* LANES bf16 at any address */
typedef uint32_t wvec __attribute__((vector_size(4 * LANES)));

static inline vec load(const float *p) { return *(const uvec *)p; }
static inline void store(float *p, vec v) { *(uvec *)p = v; }
static inline vec load_bf16(const uint16_t *p) { /* exact: bf16 is the top half of a float32 */
    return (vec)(__builtin_convertvector(*(const bvec *)p, wvec) << 16);
}
typedef float quarter __attribute__((vector_size(16)));
static inline float lane_sum(vec v) { /* a fixed pairwise tree: halves, quarters, then four lanes */
#if LANES == 16
    typedef float half __attribute__((vector_size(32)));
    union { vec v; half h[2]; } a = {v};
    union { half v; quarter q[2]; } b = {a.h[0] + a.h[1]};
#else
    union { vec v; quarter q[2]; } b = {v};
#endif
    const quarter s = b.q[0] + b.q[1];
    return (s[0] + s[2]) + (s[1] + s[3]);
}
"""
"""The C passes' shared vector helpers (after ``<stdint.h>``): ``LANES`` floats a vector (16 with AVX-512,
8 otherwise), unaligned loads and stores, bf16 loads widened exactly, and a lane sum in a fixed pairwise
order (so every pass sums in the same order on one machine)."""

BF16_PRELUDE = r"""
static inline float bf16_to_f32(uint16_t h) { /* exact: bf16 is the top half of a float32 */
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}
static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's conversion */
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40); /* NaN stays quiet */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}
"""
"""The C kernels' scalar bf16 conversions (after ``<stdint.h>``): bf16 -> float32 exactly, float32 -> bf16
rounded to nearest even as torch rounds (NaN stays NaN)."""

EXP_PRELUDE = r"""
/* e^x in float32 without a call, so loops over it vectorise: 2^k e^r, k = round(x log2 e) by the
   1.5 * 2^23 rounding trick, r = x - k ln 2 in two parts, e^r by Cephes' degree-5 polynomial (relative
   error about 2e-7); overflow to inf past 88.376, underflow to 0 below -87.336 (e^-inf = 0) */
static inline float exp_f32(float x) {
    const float kf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - kf * 0.693359375f) - kf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float er = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)kf + 127) * 8388608;
    float scale;
    memcpy(&scale, &bits, 4);
    const float e = er * scale;
    return x > 88.3762626647949f ? __builtin_inff() : x < -87.3365447505531f ? 0.0f : e;
}
"""
"""The C kernels' vectorisable float32 exponential ``exp_f32`` (after ``<stdint.h>`` and ``<string.h>``):
the same operations in every kernel that includes it; each kernel's own floating-point pragmas apply."""

_SOURCE = (
    r"""
#include <stdint.h>

#define MAX_Q 8
"""
    + VECTOR_PRELUDE
    + BF16_PRELUDE
    + r"""

typedef struct {
    float *pool;             /* [S, Hv, Dv, Dk], slot stride pool_stride */
    int64_t pool_stride;
    const int64_t *slots;    /* [N]; < 0: padding row (zero state, nothing stored) */
    int64_t n, hv, dv, dk, group, q;
    /* commit (verify): r pending tokens, the first n_commit[n] applied; NULL n_commit: none */
    int64_t r;
    const int64_t *n_commit; /* [N] */
    const float *c_decay;    /* [N, Hv] */
    const float *c_coef;     /* [N, R, Hv] */
    const float *c_k;        /* [N, R, Hk, Dk] normalised */
    const float *pend;       /* pending pool: u of slot s, token l, head h at pend + s*ps + l*pt + h*dv */
    int64_t pend_slot, pend_tok;
    /* tokens */
    const float *qs, *ks;    /* [N, Q, Hk, Dk]: q scaled, k normalised */
    const float *v;          /* [N, Q, Hv, Dv] */
    const float *beta, *ecum;/* [N, Q, Hv] */
    const float *a, *b;      /* [N, Hv, Q, Q]: A (l < j), B (l <= j), [j][l] */
    /* advance (decode): NULL a_decay: none */
    const float *a_decay;    /* [N, Hv] */
    const float *a_coef;     /* [N, Q, Hv] */
    float *out;              /* [N, Q, Hv, Dv] float32, or NULL and: */
    uint16_t *out16;         /* [N, Q, Hv, Dv] bf16 (rounded to nearest even) */
    float *stash;            /* NULL, or u of slot s, token j, head h written at stash + s*ss + j*st + h*dv */
    int64_t stash_slot, stash_tok;
    int nthreads;
} gdn_args;

#define HEAD_PASS(NAME, QC)                                                                              \
static void NAME(const gdn_args *p, int64_t job) {                                                       \
    const int64_t n = job / p->hv, h = job % p->hv, hk = h / p->group;                                   \
    const int64_t Q = QC ? QC : p->q, dk = p->dk, dv = p->dv, hv = p->hv;                                \
    const int64_t slot = p->slots[n];                                                                    \
    float *state = slot >= 0 ? p->pool + slot * p->pool_stride + h * dv * dk : 0;                        \
    const int64_t nc = (state && p->n_commit) ? p->n_commit[n] : 0;                                      \
    const float *kj[MAX_Q], *qj[MAX_Q], *ck[MAX_Q], *pu[MAX_Q];                                          \
    float ecum[MAX_Q], beta[MAX_Q], cc[MAX_Q], ac[MAX_Q], A[MAX_Q][MAX_Q], B[MAX_Q][MAX_Q];             \
    for (int64_t j = 0; j < Q; ++j) {                                                                    \
        const int64_t t = (n * Q + j) * p->hv + h;                                                       \
        kj[j] = p->ks + ((n * Q + j) * (hv / p->group) + hk) * dk;                                       \
        qj[j] = p->qs + ((n * Q + j) * (hv / p->group) + hk) * dk;                                       \
        ecum[j] = p->ecum[t];                                                                            \
        beta[j] = p->beta[t];                                                                            \
        ac[j] = p->a_decay ? p->a_coef[t] : 0.0f;                                                        \
        for (int64_t l = 0; l < Q; ++l) {                                                                \
            A[j][l] = p->a[(job * Q + j) * Q + l];                                                       \
            B[j][l] = p->b[(job * Q + j) * Q + l];                                                       \
        }                                                                                                \
    }                                                                                                    \
    for (int64_t l = 0; l < nc; ++l) {                                                                   \
        ck[l] = p->c_k + ((n * p->r + l) * (hv / p->group) + hk) * dk;                                   \
        pu[l] = p->pend + slot * p->pend_slot + l * p->pend_tok + h * dv;                                \
        cc[l] = p->c_coef[(n * p->r + l) * hv + h];                                                      \
    }                                                                                                    \
    const float dc = nc ? p->c_decay[job] : 1.0f;                                                        \
    const float ad = p->a_decay ? p->a_decay[job] : 1.0f;                                                \
    for (int64_t i = 0; i < dv; ++i) {                                                                   \
        float *row = state ? state + i * dk : 0;                                                         \
        float cu[MAX_Q], sk[MAX_Q], sq[MAX_Q];                                                           \
        for (int64_t l = 0; l < nc; ++l) cu[l] = cc[l] * pu[l][i];                                       \
        vec ak[QC ? QC : MAX_Q], aq[QC ? QC : MAX_Q];                                                    \
        float tk[QC ? QC : MAX_Q], tq[QC ? QC : MAX_Q];                                                  \
        for (int64_t j = 0; j < Q; ++j) { ak[j] = (vec){0}; aq[j] = (vec){0}; tk[j] = 0.0f; tq[j] = 0.0f; } \
        if (row) {                                                                                       \
            int64_t c = 0;                                                                               \
            for (; c + LANES <= dk; c += LANES) {                                                        \
                vec s = load(row + c);                                                                   \
                if (nc) {                                                                                \
                    vec t = (vec){0};                                                                    \
                    for (int64_t l = 0; l < nc; ++l) t += cu[l] * load(ck[l] + c);                       \
                    s = s * dc + t;                                                                      \
                    store(row + c, s);                                                                   \
                }                                                                                        \
                for (int64_t j = 0; j < Q; ++j) {                                                        \
                    ak[j] += s * load(kj[j] + c);                                                        \
                    aq[j] += s * load(qj[j] + c);                                                        \
                }                                                                                        \
            }                                                                                            \
            for (; c < dk; ++c) {                                                                        \
                float s = row[c];                                                                        \
                if (nc) {                                                                                \
                    float t = 0.0f;                                                                      \
                    for (int64_t l = 0; l < nc; ++l) t += cu[l] * ck[l][c];                              \
                    s = s * dc + t;                                                                      \
                    row[c] = s;                                                                          \
                }                                                                                        \
                for (int64_t j = 0; j < Q; ++j) { tk[j] += s * kj[j][c]; tq[j] += s * qj[j][c]; }        \
            }                                                                                            \
        }                                                                                                \
        for (int64_t j = 0; j < Q; ++j) { sk[j] = lane_sum(ak[j]) + tk[j]; sq[j] = lane_sum(aq[j]) + tq[j]; } \
        float uj[MAX_Q];                                                                                 \
        for (int64_t j = 0; j < Q; ++j) {                                                                \
            float acc_u = ecum[j] * sk[j], acc_o = ecum[j] * sq[j];                                      \
            for (int64_t l = 0; l < j; ++l) { acc_u += A[j][l] * uj[l]; acc_o += B[j][l] * uj[l]; }      \
            const int64_t o = ((n * Q + j) * hv + h) * dv + i;                                           \
            uj[j] = beta[j] * (p->v[o] - acc_u);                                                         \
            if (p->stash && row) p->stash[slot * p->stash_slot + j * p->stash_tok + h * dv + i] = uj[j];  \
            const float oj = acc_o + B[j][j] * uj[j];                                                    \
            if (p->out16) p->out16[o] = f32_to_bf16(oj); else p->out[o] = oj;                            \
        }                                                                                                \
        if (row && p->a_decay) {                                                                         \
            float w[MAX_Q];                                                                              \
            for (int64_t j = 0; j < Q; ++j) w[j] = ac[j] * uj[j];                                        \
            int64_t c = 0;                                                                               \
            for (; c + LANES <= dk; c += LANES) {                                                        \
                vec t = (vec){0};                                                                        \
                for (int64_t j = 0; j < Q; ++j) t += w[j] * load(kj[j] + c);                             \
                store(row + c, load(row + c) * ad + t);                                                  \
            }                                                                                            \
            for (; c < dk; ++c) {                                                                        \
                float t = 0.0f;                                                                          \
                for (int64_t j = 0; j < Q; ++j) t += w[j] * kj[j][c];                                    \
                row[c] = row[c] * ad + t;                                                                \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
}

HEAD_PASS(head_any, 0)
HEAD_PASS(head_q1, 1)
HEAD_PASS(head_q2, 2)
HEAD_PASS(head_q3, 3)
HEAD_PASS(head_q4, 4)

void gdn_pass(const gdn_args *p) {
    void (*head)(const gdn_args *, int64_t) =
        p->q == 1 ? head_q1 : p->q == 2 ? head_q2 : p->q == 3 ? head_q3 : p->q == 4 ? head_q4 : head_any;
    const int64_t jobs = p->n * p->hv;
    #pragma omp parallel for schedule(static) num_threads(p->nthreads) if (p->nthreads > 1)
    for (int64_t job = 0; job < jobs; ++job) head(p, job);
}
"""
)

_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=gnu99")


class _Args(ctypes.Structure):
    _fields_ = [
        ("pool", ctypes.c_void_p), ("pool_stride", ctypes.c_int64), ("slots", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("hv", ctypes.c_int64), ("dv", ctypes.c_int64), ("dk", ctypes.c_int64),
        ("group", ctypes.c_int64), ("q", ctypes.c_int64),
        ("r", ctypes.c_int64), ("n_commit", ctypes.c_void_p), ("c_decay", ctypes.c_void_p),
        ("c_coef", ctypes.c_void_p), ("c_k", ctypes.c_void_p), ("pend", ctypes.c_void_p),
        ("pend_slot", ctypes.c_int64), ("pend_tok", ctypes.c_int64),
        ("qs", ctypes.c_void_p), ("ks", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("beta", ctypes.c_void_p), ("ecum", ctypes.c_void_p), ("a", ctypes.c_void_p), ("b", ctypes.c_void_p),
        ("a_decay", ctypes.c_void_p), ("a_coef", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("out16", ctypes.c_void_p), ("stash", ctypes.c_void_p), ("stash_slot", ctypes.c_int64),
        ("stash_tok", ctypes.c_int64), ("nthreads", ctypes.c_int),
    ]  # fmt: skip


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _compile(compiler: str, cache: Path, source: str, stem: str) -> Path | None:
    """The shared library built from ``source`` for this compiler and CPU (built now if not cached), or
    None."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("atom_kernels cpu GDN: C compiler %s does not run (%s); torch forms used", compiler, e)
        return None
    key = hashlib.sha256("\0".join((source, *_FLAGS, version, _cpu_flags())).encode()).hexdigest()[:24]
    lib = cache / f"{stem}_{key}.so"
    if lib.exists():
        return lib
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, out = Path(tmp) / f"{stem}.c", Path(tmp) / "lib.so"
            src.write_text(source)
            done = subprocess.run(
                [compiler, *_FLAGS, str(src), "-o", str(out)], capture_output=True, timeout=300
            )
            if done.returncode != 0:
                err = done.stderr.decode(errors="replace").strip().splitlines()
                logger.warning(
                    "atom_kernels cpu GDN: building the C pass with %s failed (%s); torch forms used",
                    compiler,
                    err[0] if err else f"exit {done.returncode}",
                )
                return None
            os.replace(out, lib)  # atomic: concurrent builders of the same key write the same bytes
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning(
            "atom_kernels cpu GDN: building the C pass in %s failed (%s); torch forms used", cache, e
        )
        return None
    return lib


def build(source: str, stem: str, function: str, args_type: type[ctypes.Structure]):
    """The C function ``void function(const args_type *)`` of ``source``, compiled once per machine into
    the cache directory (module docstring), or None where no C compiler builds it (logged as a warning:
    the torch forms are slower)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        logger.warning("atom_kernels cpu GDN: no C compiler ($CC, cc, gcc); the slower torch forms are used")
        return None
    cache = Path(os.environ.get("ATOM_KERNELS_CACHE") or Path.home() / ".cache" / "atom_kernels")
    lib = _compile(compiler, cache, source, stem)
    if lib is None:
        return None
    fn = getattr(ctypes.CDLL(str(lib)), function)
    fn.argtypes = [ctypes.POINTER(args_type)]
    fn.restype = None
    return fn


@functools.cache
def load():
    """The compiled ``gdn_pass`` function, or None where no C compiler builds it."""
    return build(_SOURCE, "gdn_pass", "gdn_pass", _Args)


def usable(ssm_state: torch.Tensor, q_len: int) -> bool:
    """Whether :func:`gdn_pass` takes this pool and ``q_len`` tokens: a float32 pool whose slot states
    are contiguous, ``q_len <= MAX_TOKENS``, and a C build."""
    if q_len > MAX_TOKENS or ssm_state.dtype != torch.float32 or ssm_state.shape[0] == 0:
        return False
    return ssm_state[0].is_contiguous() and load() is not None


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def gdn_pass(
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    q32: torch.Tensor,
    k32: torch.Tensor,
    v32: torch.Tensor,
    b32: torch.Tensor,
    ecum: torch.Tensor,
    coef_a: torch.Tensor,
    coef_b: torch.Tensor,
    commit: tuple[torch.Tensor, ...] | None = None,
    advance: tuple[torch.Tensor, torch.Tensor] | None = None,
    stash: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pass of the module docstring on the float32 pool ``ssm_state [S, Hv, Dv, Dk]`` (:func:`usable`).

    Args:
        slots: ``[N]`` int64 (< 0: padding row).
        q32, k32: ``[N, Q, Hk, Dk]`` float32, q scaled, k normalised (key heads, not repeated).
        v32: ``[N, Q, Hv, Dv]``; b32, ecum: ``[N, Q, Hv]`` (``beta``, ``e^{cum_j}``).
        coef_a, coef_b: ``[N, Hv, Q, Q]``, ``[j, l]``: ``A`` (used for l < j), ``B`` (l <= j).
        commit: ``(n_commit [N] int64, decay [N, Hv], coef [N, R, Hv], k [N, R, Hk, Dk] normalised,
            pending [S, R, P])``: commit the first ``n_commit`` pending tokens of each slot first (their
            ``u`` read from ``pending`` at offset ``Hk*Dk`` of each token), store.
        advance: ``(decay [N, Hv], coef [N, Q, Hv])``: after the tokens, ``S = decay S + sum coef u k``;
            store.
        stash: the pending pool ``[S, R, P]`` (float32, last dim contiguous) or None: each real row's
            tokens' ``u`` written to its slot's first Q tokens at offset ``Hk*Dk`` (after the commit read
            the same row's pending ``u``).

    Returns:
        ``o [N, Q, Hv, Dv]`` float32.
    """
    num_seqs, q_len, num_k_heads, dk = k32.shape
    _, num_v_heads, dv, _ = ssm_state.shape
    out = torch.empty(num_seqs, q_len, num_v_heads, dv, dtype=torch.float32, device=ssm_state.device)
    if num_seqs == 0:
        return out
    keep = [slots := slots.long().contiguous(), q32 := _f32(q32), k32 := _f32(k32), v32 := _f32(v32)]
    keep += [b32 := _f32(b32), ecum := _f32(ecum), coef_a := _f32(coef_a), coef_b := _f32(coef_b)]
    args = _Args(
        pool=ssm_state.data_ptr(), pool_stride=ssm_state.stride(0), slots=slots.data_ptr(),
        n=num_seqs, hv=num_v_heads, dv=dv, dk=dk, group=num_v_heads // num_k_heads, q=q_len,
        qs=q32.data_ptr(), ks=k32.data_ptr(), v=v32.data_ptr(), beta=b32.data_ptr(), ecum=ecum.data_ptr(),
        a=coef_a.data_ptr(), b=coef_b.data_ptr(), out=out.data_ptr(),
        nthreads=torch.get_num_threads(),
    )  # fmt: skip
    if commit is not None:
        n_commit, c_decay, c_coef, c_k, pending = commit
        keep += [n_commit := n_commit.long().contiguous(), c_decay := _f32(c_decay), c_coef := _f32(c_coef)]
        keep.append(c_k := _f32(c_k))
        args.r, args.n_commit, args.c_decay = c_k.shape[1], n_commit.data_ptr(), c_decay.data_ptr()
        args.c_coef, args.c_k = c_coef.data_ptr(), c_k.data_ptr()
        args.pend = pending.data_ptr() + num_k_heads * dk * pending.element_size()
        args.pend_slot, args.pend_tok = pending.stride(0), pending.stride(1)
    if stash is not None:
        args.stash = stash.data_ptr() + num_k_heads * dk * stash.element_size()
        args.stash_slot, args.stash_tok = stash.stride(0), stash.stride(1)
    if advance is not None:
        keep += [a_decay := _f32(advance[0]), a_coef := _f32(advance[1])]
        args.a_decay, args.a_coef = a_decay.data_ptr(), a_coef.data_ptr()
    load()(ctypes.byref(args))
    del keep  # the contiguous copies lived through the call
    return out
