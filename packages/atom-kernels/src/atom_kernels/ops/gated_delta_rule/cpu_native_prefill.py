"""The cpu backend's chunked GDN (prefill) on a float32 state pool, token by token with each state row held
in registers, in C.

The gated delta rule is local to a state row: row ``i`` of ``S`` (``Dk`` floats, value channel ``i`` of
head ``h``) evolves with the tokens' ``k``, ``q``, gates and its own ``v`` channel only::

    s = e^{g_t} s;   u = beta_t (v_{t,i} - s . k_t);   s = s + u k_t;   o_{t,i} = s . q_t

(q scaled, q and k L2-normalised by the caller). One pass over the row per token does the update and both
dot products the next step needs: ``s = e_t s + u_t k_t`` while summing ``s . q_t`` (this token's output)
and ``s . k_{t+1}`` (the next token's ``s . k``, which its decay then scales). A block of rows is loaded
from the pool once (or zeroed: no initial state, or a padding row), carried through all of its sequence's
tokens, and stored once (padding rows store nothing): about ``4 Dk`` flops per token and row, the state
read and written once, no chunk matrices. Rows are independent, so the work splits over (sequence, head,
block of rows) jobs run by ``torch.get_num_threads()`` OpenMP threads. Float32 math as the reference's
recurrent form up to the order of the sums (16 lanes, then a fixed pairwise tree) and the decay applied to
``s . k`` after the sum; no fast-math flag. Built and loaded like
:mod:`~atom_kernels.ops.gated_delta_rule.cpu_native` (same cache, compiler and flags).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from atom_kernels.ops.gated_delta_rule.cpu_native import build
from atom_kernels.ops.l2norm.reference import l2norm_f32

MAX_HEAD_DIM = 256
"""Largest ``Dk`` the pass takes (a multiple of 16); other head dims take the torch chunked form."""

_SOURCE = r"""
#include <stdint.h>

#define LANES 16
#define MAX_VECS 16                                               /* Dk <= 256 */
#define ROWS 8                                                    /* rows carried together */
#define JOB_ROWS 32                                               /* rows per job */
typedef float vec __attribute__((vector_size(64)));              /* 16 floats: one AVX-512 register */
typedef float uvec __attribute__((vector_size(64), aligned(4)));  /* the same at any float address */

static inline vec load(const float *p) { return *(const uvec *)p; }
static inline void store(float *p, vec v) { *(uvec *)p = v; }
typedef float half __attribute__((vector_size(32)));
typedef float quarter __attribute__((vector_size(16)));
static inline float lane_sum(vec v) { /* a fixed pairwise tree: halves, quarters, then four lanes */
    union { vec v; half h[2]; } a = {v};
    union { half v; quarter q[2]; } b = {a.h[0] + a.h[1]};
    const quarter s = b.q[0] + b.q[1];
    return (s[0] + s[2]) + (s[1] + s[3]);
}

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

typedef struct {
    float *pool;                /* [S, Hv, Dv, Dk], slot stride pool_stride */
    int64_t pool_stride;
    const int64_t *slots;       /* [N]; < 0: padding (zero state, nothing stored) */
    const uint8_t *init;        /* [N]: start from the slot's state (else from zero) */
    const int64_t *offsets;     /* [N + 1] token offsets */
    int64_t n, hv, hk, dv, dk;
    const float *qs, *ks;       /* [T, Hk, Dk]: q scaled, both normalised */
    const float *v;             /* [T, Hv, Dv] */
    const float *decay, *beta;  /* [T, Hv]: e^g, beta */
    float *out;                 /* [T, Hv, Dv] */
    int nthreads;
} prefill_args;

/* Rows i0 .. i0 + R - 1 of head h of sequence n, through all of its tokens. NV: Dk / 16 (0: p->dk / 16). */
#define ROW_BLOCK(NAME, R, NV)                                                                           \
static void NAME(const prefill_args *p, int64_t n, int64_t h, int64_t i0) {                              \
    const int64_t nv = NV ? NV : p->dk / LANES, dk = nv * LANES, hv = p->hv, dv = p->dv;                 \
    const int64_t hk = h / (hv / p->hk), t0 = p->offsets[n], t1 = p->offsets[n + 1];                     \
    const int64_t slot = p->slots[n];                                                                    \
    float *rows = slot >= 0 ? p->pool + slot * p->pool_stride + (h * dv + i0) * dk : 0;                  \
    const int from_pool = rows && p->init[n];                                                            \
    vec s[R][NV ? NV : MAX_VECS];                                                                        \
    float pk[R];                                                                                         \
    for (int r = 0; r < R; ++r) {                                                                        \
        vec ak = (vec){0};                                                                               \
        const float *k0 = p->ks + (t0 * p->hk + hk) * dk;                                                \
        for (int64_t c = 0; c < nv; ++c) {                                                               \
            s[r][c] = from_pool ? load(rows + r * dk + c * LANES) : (vec){0};                            \
            if (from_pool && t1 > t0) ak += s[r][c] * load(k0 + c * LANES);                              \
        }                                                                                                \
        pk[r] = lane_sum(ak);                                                                            \
    }                                                                                                    \
    for (int64_t t = t0; t < t1; ++t) {                                                                  \
        const int64_t th = t * hv + h;                                                                   \
        const float e = p->decay[th], b = p->beta[th];                                                   \
        const float *kt = p->ks + (t * p->hk + hk) * dk, *qt = p->qs + (t * p->hk + hk) * dk;            \
        const float *kn = t + 1 < t1 ? kt + p->hk * dk : kt;                                             \
        float u[R];                                                                                      \
        vec aq[R][2], ak[R][2]; /* under 8 rows: even / odd vectors, two short chains summed at the end */ \
        for (int r = 0; r < R; ++r) {                                                                    \
            u[r] = b * (p->v[th * dv + i0 + r] - e * pk[r]);                                             \
            aq[r][0] = aq[r][1] = ak[r][0] = ak[r][1] = (vec){0};                                        \
        }                                                                                                \
        _Pragma("GCC unroll 16")                                                                         \
        for (int64_t c = 0; c < nv; ++c) {                                                               \
            const vec kc = load(kt + c * LANES), qc = load(qt + c * LANES), nc = load(kn + c * LANES);   \
            _Pragma("GCC unroll 8")                                                                      \
            for (int r = 0; r < R; ++r) {                                                                \
                const vec x = s[r][c] * e + u[r] * kc;                                                   \
                s[r][c] = x;                                                                             \
                aq[r][R < 8 ? c & 1 : 0] += x * qc;                                                      \
                ak[r][R < 8 ? c & 1 : 0] += x * nc;                                                      \
            }                                                                                            \
        }                                                                                                \
        if (R % 4 == 0) {                                                                                \
            for (int r0 = 0; r0 < R; r0 += 4) {                                                          \
                vec both[8];                                                                             \
                float sums[8];                                                                           \
                for (int r = 0; r < 4; ++r) {                                                            \
                    both[r] = aq[r0 + r][0] + aq[r0 + r][1];                                             \
                    both[4 + r] = ak[r0 + r][0] + ak[r0 + r][1];                                         \
                }                                                                                        \
                lane_sums8(both, sums);                                                                  \
                for (int r = 0; r < 4; ++r) {                                                            \
                    p->out[th * dv + i0 + r0 + r] = sums[r];                                             \
                    pk[r0 + r] = sums[4 + r];                                                            \
                }                                                                                        \
            }                                                                                            \
        } else {                                                                                         \
            for (int r = 0; r < R; ++r) {                                                                \
                p->out[th * dv + i0 + r] = lane_sum(aq[r][0] + aq[r][1]);                                \
                pk[r] = lane_sum(ak[r][0] + ak[r][1]);                                                   \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    if (rows)                                                                                            \
        for (int r = 0; r < R; ++r)                                                                      \
            for (int64_t c = 0; c < nv; ++c) store(rows + r * dk + c * LANES, s[r][c]);                  \
}

ROW_BLOCK(block_128, ROWS, 8)
ROW_BLOCK(row_128, 1, 8)
ROW_BLOCK(block_any, ROWS, 0)
ROW_BLOCK(row_any, 1, 0)

void gdn_prefill(const prefill_args *p) {
    const int d128 = p->dk == 128;
    const int64_t per_head = (p->dv + JOB_ROWS - 1) / JOB_ROWS, jobs = p->n * p->hv * per_head;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(p->nthreads) if (p->nthreads > 1)
    for (int64_t job = 0; job < jobs; ++job) {
        const int64_t n = job / (p->hv * per_head), h = job / per_head % p->hv;
        const int64_t lo = job % per_head * JOB_ROWS, hi = lo + JOB_ROWS < p->dv ? lo + JOB_ROWS : p->dv;
        int64_t i = lo;
        for (; i + ROWS <= hi; i += ROWS) (d128 ? block_128 : block_any)(p, n, h, i);
        for (; i < hi; ++i) (d128 ? row_128 : row_any)(p, n, h, i);
    }
}
"""


class _Args(ctypes.Structure):
    _fields_ = [
        ("pool", ctypes.c_void_p), ("pool_stride", ctypes.c_int64), ("slots", ctypes.c_void_p),
        ("init", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("hv", ctypes.c_int64), ("hk", ctypes.c_int64), ("dv", ctypes.c_int64),
        ("dk", ctypes.c_int64), ("qs", ctypes.c_void_p), ("ks", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("decay", ctypes.c_void_p), ("beta", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("nthreads", ctypes.c_int),
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
    on a pool :func:`usable` takes; returns ``o [T, Hv, Dv]`` in q.dtype, the final states stored."""
    total, num_v_heads, dv = v.shape
    num_k_heads, dk = q.shape[1:]
    out = torch.empty(total, num_v_heads, dv, dtype=torch.float32, device=q.device)
    num_seqs = state_indices.shape[0]
    q32, k32 = q.float().contiguous(), k.float().contiguous()
    if use_qk_l2norm:
        q32, k32 = l2norm_f32(q32), l2norm_f32(k32)
    q32 = (q32 * scale).contiguous()
    keep = [
        q32,
        k32 := k32.contiguous(),
        v32 := v.float().contiguous(),
        decay := g.float().exp().contiguous(),
    ]
    keep += [b32 := beta.float().contiguous(), slots := state_indices.long().contiguous()]
    keep += [
        init := has_initial_state.to(torch.uint8).contiguous(),
        offsets := cu_seqlens.long().contiguous(),
    ]
    args = _Args(
        pool=ssm_state.data_ptr(), pool_stride=ssm_state.stride(0), slots=slots.data_ptr(),
        init=init.data_ptr(), offsets=offsets.data_ptr(), n=num_seqs, hv=num_v_heads, hk=num_k_heads,
        dv=dv, dk=dk, qs=q32.data_ptr(), ks=k32.data_ptr(), v=v32.data_ptr(), decay=decay.data_ptr(),
        beta=b32.data_ptr(), out=out.data_ptr(), nthreads=torch.get_num_threads(),
    )  # fmt: skip
    if num_seqs:
        load()(ctypes.byref(args))
    del keep  # the contiguous copies lived through the call
    return out.to(q.dtype)
