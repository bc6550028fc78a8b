"""The cpu backend's chunked GDN (prefill) on a float32 state pool, token by token with each state row held
in registers, in C.

The gated delta rule is local to a state row: row ``i`` of ``S`` (``Dk`` floats, value channel ``i`` of
head ``h``) evolves with the tokens' ``k``, ``q``, gates and its own ``v`` channel only::

    s = e^{g_t} s;   u = beta_t (v_{t,i} - s . k_t);   s = s + u k_t;   o_{t,i} = s . q_t

(q scaled, q and k L2-normalised). One pass over the row per token does the update and both dot products
the next step needs: ``s = e_t s + u_t k_t`` while summing ``s . q_t`` (this token's output) and
``s . k_{t+1}`` (the next token's ``s . k``, which its decay then scales). q and k are read as they are
(float32 or bf16, any token / head strides, e.g. views of the conv output); the pass computes each token's
``1 / |k|`` and ``scale / |q|`` first and applies them to the scalars (``u``, the sums), not to the vectors,
and writes ``o`` in q's dtype (float32 or bf16, rounded to nearest even) itself: no float32 copies of the
tokens. A block of 8 rows is loaded from the pool once (or zeroed: no initial state, or a padding row),
carried through all of its sequence's tokens, and stored once (padding rows store nothing): 4 vector
operations per 16 state floats per token, the state read and written once, no chunk matrices. Rows are
independent, so the work splits over (sequence, head, 32 rows) jobs run by ``torch.get_num_threads()``
OpenMP threads. Float32 math as the reference's recurrent form up to the order of the sums (16 lanes, then
a fixed pairwise tree) and where the norms, scale and decay are applied (to sums, not vectors); no
fast-math flag. Built and loaded like :mod:`~atom_kernels.ops.gated_delta_rule.cpu_native` (same cache,
compiler and flags).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from atom_kernels.ops.gated_delta_rule.cpu_native import BF16_PRELUDE, VECTOR_PRELUDE, build
from atom_kernels.ops.l2norm.checks import DEFAULT_EPS

MAX_HEAD_DIM = 256
"""Largest ``Dk`` the pass takes (a multiple of 16); other head dims take the torch chunked form."""

_SOURCE = (
    r"""
#include <math.h>
#include <stdint.h>

#define MAX_VECS (256 / LANES)                                    /* Dk <= 256 */
#define ROWS 8                                                    /* rows carried together */
#define JOB_ROWS 32                                               /* rows per job */
"""
    + VECTOR_PRELUDE
    + r"""

#if LANES == 16
typedef int32_t ivec __attribute__((vector_size(64)));
/* out[m] = the lane sum of v[m], m < 8, all at once: pairs of vectors folded halves against halves,
   quarters, pairs of lanes, then lanes (15 shuffles, 8 adds instead of eight trees). */
static inline void lane_sums8(const vec v[8], float out[8]) {
    const ivec lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const ivec hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const ivec lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const ivec hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const ivec lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const ivec hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const ivec swap = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    vec w[4], x[2];
    for (int i = 0; i < 4; ++i)
        w[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo8) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi8);
    for (int i = 0; i < 2; ++i)
        x[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], lo4) + __builtin_shuffle(w[2 * i], w[2 * i + 1], hi4);
    vec y = __builtin_shuffle(x[0], x[1], lo2) + __builtin_shuffle(x[0], x[1], hi2);
    y += __builtin_shuffle(y, swap);
    for (int m = 0; m < 8; ++m) out[m] = y[2 * m];
}
#else
/* out[m] = lane_sum(v[m]), m < 8 */
static inline void lane_sums8(const vec v[8], float out[8]) {
    for (int m = 0; m < 8; ++m) out[m] = lane_sum(v[m]);
}
#endif
"""
    + BF16_PRELUDE
    + r"""

typedef struct {
    float *pool;                /* [S, Hv, Dv, Dk], slot stride pool_stride */
    int64_t pool_stride;
    const int64_t *slots;       /* [N]; < 0: padding (zero state, nothing stored) */
    const uint8_t *init;        /* [N]: start from the slot's state (else from zero) */
    const int64_t *offsets;     /* [N + 1] token offsets */
    int64_t n, t, hv, hk, dv, dk;
    const void *q, *k;          /* [T, Hk, Dk] as given (float32 or bf16: qk_bf16), last dim contiguous */
    int64_t q_tok, q_head, k_tok, k_head;
    const void *v;              /* [T, Hv, Dv] float32 or bf16 (v_bf16), last dim contiguous */
    int64_t v_tok, v_head;
    const float *decay, *beta;  /* [T, Hv]: e^g, beta */
    float *norms;               /* [T, Hk, 2] scratch: the factors of k and q (1 / |k|, scale / |q|) */
    float scale, eps;
    int l2norm, qk_bf16, v_bf16, out_bf16;
    void *out;                  /* [T, Hv, Dv] contiguous, float32 or bf16 (out_bf16) */
    int nthreads;
} prefill_args;

static float sum_squares(const void *x, int64_t dk, int bf16) {
    vec acc = (vec){0};
    for (int64_t c = 0; c < dk; c += LANES) {
        const vec xc = bf16 ? load_bf16((const uint16_t *)x + c) : load((const float *)x + c);
        acc += xc * xc;
    }
    return lane_sum(acc);
}

/* Rows i0 .. i0 + R - 1 of head h of sequence n, through all of its tokens. NV: Dk / LANES (0: p->dk / LANES).
   The state row is kept as is; q and k are read raw and their factors (norms) applied to the scalars:
   s = e s + (u rk_t) k_t,  o_t = rq_t (s . q_t),  s . k_{t+1} = rk_{t+1} (s . kraw_{t+1}). */
#define ROW_BLOCK(NAME, R, NV, BF, ELEM)                                                                 \
static void NAME(const prefill_args *p, int64_t n, int64_t h, int64_t i0) {                              \
    typedef ELEM elem;                                                                                   \
    const int64_t nv = NV ? NV : p->dk / LANES, dk = nv * LANES, hv = p->hv, dv = p->dv;                 \
    const int64_t hk = h / (hv / p->hk), t0 = p->offsets[n], t1 = p->offsets[n + 1];                     \
    const int64_t slot = p->slots[n];                                                                    \
    const elem *qs = (const elem *)p->q + hk * p->q_head, *ks = (const elem *)p->k + hk * p->k_head;      \
    const float *norms = p->norms + hk * 2;                                                              \
    float *rows = slot >= 0 ? p->pool + slot * p->pool_stride + (h * dv + i0) * dk : 0;                  \
    const int from_pool = rows && p->init[n];                                                            \
    vec s[R][NV ? NV : MAX_VECS];                                                                        \
    float pk[R];                                                                                         \
    for (int r = 0; r < R; ++r) {                                                                        \
        vec ak = (vec){0};                                                                               \
        const elem *k0 = ks + t0 * p->k_tok;                                                             \
        for (int64_t c = 0; c < nv; ++c) {                                                               \
            s[r][c] = from_pool ? load(rows + r * dk + c * LANES) : (vec){0};                            \
            if (from_pool && t1 > t0)                                                                    \
                ak += s[r][c] * (BF ? load_bf16((const uint16_t *)k0 + c * LANES)                        \
                                    : load((const float *)k0 + c * LANES));                              \
        }                                                                                                \
        pk[r] = from_pool && t1 > t0 ? norms[t0 * p->hk * 2] * lane_sum(ak) : 0.0f;                      \
    }                                                                                                    \
    for (int64_t t = t0; t < t1; ++t) {                                                                  \
        const int64_t th = t * hv + h;                                                                   \
        const float e = p->decay[th], b = p->beta[th];                                                   \
        const float rk = norms[t * p->hk * 2], rq = norms[t * p->hk * 2 + 1];                            \
        const float rkn = t + 1 < t1 ? norms[(t + 1) * p->hk * 2] : 0.0f;                                \
        const elem *kt = ks + t * p->k_tok, *qt = qs + t * p->q_tok;                                     \
        const elem *kn = t + 1 < t1 ? kt + p->k_tok : kt;                                                \
        const char *vt = (const char *)p->v + (t * p->v_tok + h * p->v_head + i0) * (p->v_bf16 ? 2 : 4); \
        float u[R];                                                                                      \
        vec aq[R][2], ak[R][2]; /* under 8 rows: even / odd vectors, two short chains summed at the end */ \
        for (int r = 0; r < R; ++r) {                                                                    \
            const float vr = p->v_bf16 ? bf16_to_f32(((const uint16_t *)vt)[r]) : ((const float *)vt)[r]; \
            u[r] = b * (vr - e * pk[r]) * rk;                                                            \
            aq[r][0] = aq[r][1] = ak[r][0] = ak[r][1] = (vec){0};                                        \
        }                                                                                                \
        _Pragma("GCC unroll 16")                                                                         \
        for (int64_t c = 0; c < nv; ++c) {                                                               \
            const vec kc = BF ? load_bf16((const uint16_t *)kt + c * LANES) : load((const float *)kt + c * LANES); \
            const vec qc = BF ? load_bf16((const uint16_t *)qt + c * LANES) : load((const float *)qt + c * LANES); \
            const vec nc = BF ? load_bf16((const uint16_t *)kn + c * LANES) : load((const float *)kn + c * LANES); \
            _Pragma("GCC unroll 8")                                                                      \
            for (int r = 0; r < R; ++r) {                                                                \
                const vec x = s[r][c] * e + u[r] * kc;                                                   \
                s[r][c] = x;                                                                             \
                aq[r][R < 8 ? c & 1 : 0] += x * qc;                                                      \
                ak[r][R < 8 ? c & 1 : 0] += x * nc;                                                      \
            }                                                                                            \
        }                                                                                                \
        float sq[R], sk[R];                                                                              \
        if (R % 4 == 0) {                                                                                \
            for (int r0 = 0; r0 < R; r0 += 4) {                                                          \
                vec both[8];                                                                             \
                float sums[8];                                                                           \
                for (int r = 0; r < 4; ++r) {                                                            \
                    both[r] = aq[r0 + r][0] + aq[r0 + r][1];                                             \
                    both[4 + r] = ak[r0 + r][0] + ak[r0 + r][1];                                         \
                }                                                                                        \
                lane_sums8(both, sums);                                                                  \
                for (int r = 0; r < 4; ++r) { sq[r0 + r] = sums[r]; sk[r0 + r] = sums[4 + r]; }         \
            }                                                                                            \
        } else {                                                                                         \
            for (int r = 0; r < R; ++r) {                                                                \
                sq[r] = lane_sum(aq[r][0] + aq[r][1]);                                                   \
                sk[r] = lane_sum(ak[r][0] + ak[r][1]);                                                   \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < R; ++r) {                                                                    \
            const float o = rq * sq[r];                                                                  \
            if (p->out_bf16) ((uint16_t *)p->out)[th * dv + i0 + r] = f32_to_bf16(o);                    \
            else ((float *)p->out)[th * dv + i0 + r] = o;                                                \
            pk[r] = rkn * sk[r];                                                                         \
        }                                                                                                \
    }                                                                                                    \
    if (rows)                                                                                            \
        for (int r = 0; r < R; ++r)                                                                      \
            for (int64_t c = 0; c < nv; ++c) store(rows + r * dk + c * LANES, s[r][c]);                  \
}

ROW_BLOCK(block_128, ROWS, 128 / LANES, 0, float)
ROW_BLOCK(row_128, 1, 128 / LANES, 0, float)
ROW_BLOCK(block_any, ROWS, 0, 0, float)
ROW_BLOCK(row_any, 1, 0, 0, float)
ROW_BLOCK(block_128_bf16, ROWS, 128 / LANES, 1, uint16_t)
ROW_BLOCK(row_128_bf16, 1, 128 / LANES, 1, uint16_t)
ROW_BLOCK(block_any_bf16, ROWS, 0, 1, uint16_t)
ROW_BLOCK(row_any_bf16, 1, 0, 1, uint16_t)

void gdn_prefill(const prefill_args *p) {
    const int64_t pairs = p->t * p->hk;
    #pragma omp parallel for schedule(static) num_threads(p->nthreads) if (p->nthreads > 1)
    for (int64_t j = 0; j < pairs; ++j) { /* the factors of each token's k and q */
        const int64_t t = j / p->hk, hk = j % p->hk, es = p->qk_bf16 ? 2 : 4;
        const char *kj = (const char *)p->k + (t * p->k_tok + hk * p->k_head) * es;
        const char *qj = (const char *)p->q + (t * p->q_tok + hk * p->q_head) * es;
        p->norms[2 * j] = p->l2norm ? 1.0f / sqrtf(sum_squares(kj, p->dk, p->qk_bf16) + p->eps) : 1.0f;
        p->norms[2 * j + 1] =
            p->l2norm ? p->scale / sqrtf(sum_squares(qj, p->dk, p->qk_bf16) + p->eps) : p->scale;
    }
    void (*block)(const prefill_args *, int64_t, int64_t, int64_t), (*row)(const prefill_args *, int64_t, int64_t, int64_t);
    if (p->qk_bf16) { block = p->dk == 128 ? block_128_bf16 : block_any_bf16; row = p->dk == 128 ? row_128_bf16 : row_any_bf16; }
    else { block = p->dk == 128 ? block_128 : block_any; row = p->dk == 128 ? row_128 : row_any; }
    const int64_t per_head = (p->dv + JOB_ROWS - 1) / JOB_ROWS, jobs = p->n * p->hv * per_head;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(p->nthreads) if (p->nthreads > 1)
    for (int64_t job = 0; job < jobs; ++job) {
        const int64_t n = job / (p->hv * per_head), h = job / per_head % p->hv;
        const int64_t lo = job % per_head * JOB_ROWS, hi = lo + JOB_ROWS < p->dv ? lo + JOB_ROWS : p->dv;
        int64_t i = lo;
        for (; i + ROWS <= hi; i += ROWS) block(p, n, h, i);
        for (; i < hi; ++i) row(p, n, h, i);
    }
}
"""
)


class _Args(ctypes.Structure):
    _fields_ = [
        ("pool", ctypes.c_void_p), ("pool_stride", ctypes.c_int64), ("slots", ctypes.c_void_p),
        ("init", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("t", ctypes.c_int64), ("hv", ctypes.c_int64), ("hk", ctypes.c_int64),
        ("dv", ctypes.c_int64), ("dk", ctypes.c_int64),
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("q_tok", ctypes.c_int64), ("q_head", ctypes.c_int64),
        ("k_tok", ctypes.c_int64), ("k_head", ctypes.c_int64),
        ("v", ctypes.c_void_p), ("v_tok", ctypes.c_int64), ("v_head", ctypes.c_int64),
        ("decay", ctypes.c_void_p), ("beta", ctypes.c_void_p), ("norms", ctypes.c_void_p),
        ("scale", ctypes.c_float), ("eps", ctypes.c_float),
        ("l2norm", ctypes.c_int), ("qk_bf16", ctypes.c_int), ("v_bf16", ctypes.c_int), ("out_bf16", ctypes.c_int),
        ("out", ctypes.c_void_p), ("nthreads", ctypes.c_int),
    ]  # fmt: skip


@functools.cache
def load():
    """The compiled ``gdn_prefill`` function, or None where no C compiler builds it."""
    return build(_SOURCE, "gdn_prefill", "gdn_prefill", _Args)


def usable(ssm_state: torch.Tensor) -> bool:
    """Whether :func:`gdn_prefill` takes this pool: float32 with contiguous slot states, ``Dk`` a multiple
    of 16 up to :data:`MAX_HEAD_DIM`, and a C build."""
    dk = ssm_state.shape[-1]
    if ssm_state.dtype != torch.float32 or ssm_state.shape[0] == 0 or dk % 16 or dk > MAX_HEAD_DIM:
        return False
    return ssm_state[0].is_contiguous() and load() is not None


_RAW = (torch.float32, torch.bfloat16)
"""The token dtypes the pass reads (and writes) as they are; others are converted to float32 first."""


def _raw(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the pass reads it: float32 or bf16 with a contiguous last dim (a view where it already is)."""
    x = x if x.dtype in _RAW else x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """:func:`~atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_chunked` (checked arguments)
    on a pool :func:`usable` takes; returns ``o [T, Hv, Dv]`` in q.dtype, the final states stored.

    q, k and v are read in place (float32 or bf16, any token and head strides); the L2 norms of q and k
    and the scale are computed by the pass and applied to its scalars, the output is written in q.dtype
    (float32 / bf16) directly."""
    total, num_v_heads, dv = v.shape
    num_k_heads, dk = q.shape[1:]
    num_seqs = state_indices.shape[0]
    dtype = q.dtype
    out = torch.empty(
        total, num_v_heads, dv, dtype=dtype if dtype in _RAW else torch.float32, device=q.device
    )
    if num_seqs == 0:
        return out.to(dtype)
    q, k, v = _raw(q), _raw(k), _raw(v)
    keep = [q, k, v, decay := g.float().exp().contiguous(), b32 := beta.float().contiguous()]
    keep += [
        slots := state_indices.long().contiguous(),
        init := has_initial_state.to(torch.uint8).contiguous(),
    ]
    keep += [offsets := cu_seqlens.long().contiguous(), norms := torch.empty(total, num_k_heads, 2)]
    args = _Args(
        pool=ssm_state.data_ptr(), pool_stride=ssm_state.stride(0), slots=slots.data_ptr(),
        init=init.data_ptr(), offsets=offsets.data_ptr(), n=num_seqs, t=total, hv=num_v_heads,
        hk=num_k_heads, dv=dv, dk=dk, q=q.data_ptr(), k=k.data_ptr(), q_tok=q.stride(0), q_head=q.stride(1),
        k_tok=k.stride(0), k_head=k.stride(1), v=v.data_ptr(), v_tok=v.stride(0), v_head=v.stride(1),
        decay=decay.data_ptr(), beta=b32.data_ptr(), norms=norms.data_ptr(), scale=scale, eps=DEFAULT_EPS,
        l2norm=int(use_qk_l2norm), qk_bf16=int(q.dtype == torch.bfloat16), v_bf16=int(v.dtype == torch.bfloat16),
        out_bf16=int(out.dtype == torch.bfloat16), out=out.data_ptr(), nthreads=torch.get_num_threads(),
    )  # fmt: skip
    load()(ctypes.byref(args))
    del keep  # the copies lived through the call
    return out.to(dtype)
