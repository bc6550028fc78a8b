"""The cpu backend's whole GDN verify or decode step in one C call: the inputs' preparation, then the C
state pass.

:mod:`.cpu_native` takes its per-token and per-head inputs already prepared (q scaled and k normalised in
float32, the gates, the closed form's coefficients, the pending tokens to commit, decode's advance);
prepared in torch, that is some sixty small ops per layer and step, which at serving batch sizes cost
about as much as the pass. Here one C call (``gdn_step``) first checks the slots (``< S``) and the commit
counts (in ``[0, R]``) and returns an error code before writing anything (the caller raises the shared
checks' errors), then a loop over the sequences prepares the pass's inputs from the op's own arguments
(bf16 or float32, the conv output's row strides), each sequence's row of the pending pool and of
``pending_pos`` included:

- gates: the given ``g`` / ``beta``, or under fused gating the reference gating op's float32 expressions
  ``g = -e^{A_log} softplus(a + dt_bias)`` (softplus ``log1p(e^x)``, ``x`` past 20 as is) and
  ``beta = 1 / (1 + e^{-b})``; ``cum_j = g_0 + ... + g_j`` per value head, ``ecum = e^{cum}``;
- q, k: float32, L2-normalised (``x * 1 / sqrt(sum x^2 + eps)``) per key head where asked, q then scaled;
- ``A_{jl} = e^{cum_j - cum_l} (k_l . k_j)``, ``B_{jl} = e^{cum_j - cum_l} (k_l . q_j)``;
- verify: the commit of the first ``num_commit`` pending tokens (their k normalised, ``e^{C}`` and
  ``e^{C - pcum_l}`` of their gates' cumsum, ``C`` its last entry) and the stash of this step's tokens
  (raw k as float32 and g into the slot's pending row after the commit read them, ``pending_pos +=
  num_commit``);
- decode (no pending pool): the advance past the tokens, ``e^{C}`` and ``e^{C - cum_j}`` (``C = cum_{Q-1}``);

then the same process runs :mod:`.cpu_native`'s pass over the ``N * Hv`` state heads (commit, outputs
written in the tokens' dtype, ``u`` into the pending pool, or decode's advance). The math is
:func:`.cpu._verify_native`'s and the recurrent op's torch preparation, the float32 expressions in the same
order (no contraction into fused multiply-adds in the preparation); ``exp``, ``log1p`` and the dot
products' summation order are the C library's and this loop's, not torch's (an ulp of a gate now and then;
tolerances in the tests). Padding rows (``slot < 0``) prepare from their inputs, commit nothing and store
nothing.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from atom_kernels.ops._checks import check_num_accepted_values, check_slot_values
from atom_kernels.ops.gated_delta_rule import cpu_native
from atom_kernels.ops.l2norm.checks import DEFAULT_EPS

_STEP_SOURCE = (
    r"""
#pragma GCC optimize ("fp-contract=off")
#include <math.h>
#include <string.h>
#define MAX_R 64
"""
    + r"""

static inline float ldf(const void *p, int64_t i, int bf16) {
    if (bf16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}
static inline int64_t ldi(const void *p, int64_t i, int i64) {
    return i64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

typedef struct {
    const void *tq, *tk, *tv, *ga, *gb; /* [N, Q, H, D] / [N, Q, Hv]; last dim unit stride */
    int64_t q_sn, q_st, q_sh, k_sn, k_st, k_sh, v_sn, v_st, v_sh, ga_sn, ga_st, gb_sn, gb_st;
    int qk_bf16, v_bf16, ga_bf16, gb_bf16;
    const void *a_log, *dt_bias;        /* [Hv] (fused gating: ga, gb are the raw a, b) or NULL */
    int a_log_bf16, dt_bias_bf16;
    float scale, eps; int l2norm;
    const void *slots; int slots64;     /* [N] */
    const void *commit; int commit64;   /* [N] num_commit (verify) or NULL (decode) */
    float *pending; int64_t pend_slot, pend_tok, r; /* verify: the pending pool; decode: NULL, r = 0 */
    int32_t *pos; int64_t pos_slot;     /* pending_pos [S, 1] or NULL */
    float *pool; int64_t pool_stride, num_slots;
    int64_t n, q, hk, hv, dk, dv;
    float *scratch;                     /* 2N int64 (slots, n_commit; padding: 0), then carve()'s floats */
    float *out; uint16_t *out16;        /* [N, Q, Hv, Dv]: float32 out, or NULL and bf16 out16 */
    int nthreads;
} step_args;

typedef struct {
    int64_t *slots, *n_commit;
    float *q32, *k32, *v32, *beta, *ecum, *A, *B, *c_decay, *c_coef, *c_k, *a_decay, *a_coef;
} step_bufs;

static step_bufs carve(const step_args *s) {
    const int64_t N = s->n, Q = s->q, R = s->r;
    step_bufs b;
    b.slots = (int64_t *)s->scratch;
    b.n_commit = b.slots + N;
    float *p = s->scratch + 4 * N;
    b.q32 = p; p += N * Q * s->hk * s->dk;
    b.k32 = p; p += N * Q * s->hk * s->dk;
    b.v32 = p; p += N * Q * s->hv * s->dv;
    b.beta = p; p += N * Q * s->hv;
    b.ecum = p; p += N * Q * s->hv;
    b.A = p; p += N * s->hv * Q * Q;
    b.B = p; p += N * s->hv * Q * Q;
    b.c_decay = p; p += N * s->hv;
    b.c_coef = p; p += N * R * s->hv;
    b.c_k = p; p += N * R * s->hk * s->dk;
    b.a_decay = p; p += N * s->hv;
    b.a_coef = p;
    return b;
}

static void l2(float *x, int64_t d, float eps) {
    float ss = 0.0f;
    for (int64_t c = 0; c < d; ++c) ss += x[c] * x[c];
    const float inv = 1.0f / sqrtf(ss + eps);
    for (int64_t c = 0; c < d; ++c) x[c] = x[c] * inv;
}

static void prep_seq(const step_args *s, const step_bufs *b, int64_t n) {
    const int64_t Q = s->q, hk = s->hk, hv = s->hv, dk = s->dk, dv = s->dv, R = s->r, grp = hv / hk;
    const int64_t kd = hk * dk, vd = hv * dv;
    const int64_t slot = ldi(s->slots, n, s->slots64);
    const int64_t nc = slot >= 0 && s->commit ? ldi(s->commit, n, s->commit64) : 0;
    float *prow = slot >= 0 && s->pending ? s->pending + slot * s->pend_slot : 0;
    b->slots[n] = slot;
    b->n_commit[n] = nc;
    /* 1. the commit (reads the slot's pending k and g before the stash overwrites them) */
    for (int64_t h = 0; h < hv && R; ++h) {
        float pc[MAX_R];
        float cum = 0.0f;
        for (int64_t l = 0; l < R; ++l) {
            const float pg = l < nc ? prow[l * s->pend_tok + kd + vd + h] : 0.0f;
            cum = l ? cum + pg : pg;
            pc[l] = cum;
        }
        b->c_decay[n * hv + h] = expf(cum);
        for (int64_t l = 0; l < R; ++l) b->c_coef[(n * R + l) * hv + h] = expf(cum - pc[l]);
    }
    for (int64_t l = 0; l < nc; ++l)
        for (int64_t h = 0; h < hk; ++h) {
            float *ck = b->c_k + ((n * R + l) * hk + h) * dk;
            memcpy(ck, prow + l * s->pend_tok + h * dk, dk * 4);
            if (s->l2norm) l2(ck, dk, s->eps);
        }
    /* 2. gates: given, or (fused) g = -e^{A_log} softplus(a + dt_bias) (threshold 20), beta = sigmoid(b)
       as the reference gating op's float32 expressions; cumsum kept in ecum for now */
    for (int64_t h = 0; h < hv; ++h) {
        float cum = 0.0f, neg_a = 0.0f, dt = 0.0f;
        if (s->a_log) {
            neg_a = -expf(ldf(s->a_log, h, s->a_log_bf16));
            dt = ldf(s->dt_bias, h, s->dt_bias_bf16);
        }
        for (int64_t j = 0; j < Q; ++j) {
            const float ga = ldf(s->ga, n * s->ga_sn + j * s->ga_st + h, s->ga_bf16);
            const float gb = ldf(s->gb, n * s->gb_sn + j * s->gb_st + h, s->gb_bf16);
            float gj = ga, bj = gb;
            if (s->a_log) {
                const float x = ga + dt;
                gj = neg_a * (x > 20.0f ? x : log1pf(expf(x)));
                bj = 1.0f / (1.0f + expf(-gb));
            }
            cum = j ? cum + gj : gj;
            const int64_t t = (n * Q + j) * hv + h;
            b->beta[t] = bj;
            b->ecum[t] = cum;
            if (prow) prow[j * s->pend_tok + kd + vd + h] = gj;  /* stash g */
        }
    }
    /* 3. q, k (stash raw k), v */
    for (int64_t j = 0; j < Q; ++j) {
        for (int64_t h = 0; h < hk; ++h) {
            float *qo = b->q32 + ((n * Q + j) * hk + h) * dk, *ko = b->k32 + ((n * Q + j) * hk + h) * dk;
            const int64_t qi = n * s->q_sn + j * s->q_st + h * s->q_sh;
            const int64_t ki = n * s->k_sn + j * s->k_st + h * s->k_sh;
            for (int64_t c = 0; c < dk; ++c) { qo[c] = ldf(s->tq, qi + c, s->qk_bf16); ko[c] = ldf(s->tk, ki + c, s->qk_bf16); }
            if (prow) memcpy(prow + j * s->pend_tok + h * dk, ko, dk * 4);
            if (s->l2norm) { l2(qo, dk, s->eps); l2(ko, dk, s->eps); }
            for (int64_t c = 0; c < dk; ++c) qo[c] = qo[c] * s->scale;
        }
        for (int64_t h = 0; h < hv; ++h) {
            float *vo = b->v32 + ((n * Q + j) * hv + h) * dv;
            const int64_t vi = n * s->v_sn + j * s->v_st + h * s->v_sh;
            for (int64_t c = 0; c < dv; ++c) vo[c] = ldf(s->tv, vi + c, s->v_bf16);
        }
    }
    /* 4. A, B per value head; decode's advance e^{C}, e^{C - cum_j} (C = cum_{Q-1}); then ecum = e^{cum} */
    for (int64_t h = 0; h < hv; ++h) {
        const int64_t h_k = h / grp;
        for (int64_t j = 0; j < Q; ++j) {
            const float cj = b->ecum[(n * Q + j) * hv + h];
            const float *kj = b->k32 + ((n * Q + j) * hk + h_k) * dk;
            const float *qj = b->q32 + ((n * Q + j) * hk + h_k) * dk;
            for (int64_t l = 0; l < Q; ++l) {
                const float *kl = b->k32 + ((n * Q + l) * hk + h_k) * dk;
                float kk = 0.0f, kq = 0.0f;
                for (int64_t c = 0; c < dk; ++c) { kk += kl[c] * kj[c]; kq += kl[c] * qj[c]; }
                const float w = expf(cj - b->ecum[(n * Q + l) * hv + h]);
                b->A[((n * hv + h) * Q + j) * Q + l] = w * kk;
                b->B[((n * hv + h) * Q + j) * Q + l] = w * kq;
            }
        }
        if (!s->pending) {
            const float last = b->ecum[(n * Q + Q - 1) * hv + h];
            b->a_decay[n * hv + h] = expf(last);
            for (int64_t j = 0; j < Q; ++j)
                b->a_coef[(n * Q + j) * hv + h] = expf(last - b->ecum[(n * Q + j) * hv + h]);
        }
    }
    for (int64_t j = 0; j < Q; ++j)
        for (int64_t h = 0; h < hv; ++h) b->ecum[(n * Q + j) * hv + h] = expf(b->ecum[(n * Q + j) * hv + h]);
    if (s->pos && slot >= 0) s->pos[slot * s->pos_slot] += (int32_t)ldi(s->commit, n, s->commit64);
}

/* 0, or before anything is written: 1 where a slot is >= S, 2 where a num_commit lies outside [0, R] */
int gdn_step(const step_args *s) {
    for (int64_t n = 0; n < s->n; ++n) {
        if (ldi(s->slots, n, s->slots64) >= s->num_slots) return 1;
        if (s->commit) {
            const int64_t c = ldi(s->commit, n, s->commit64);
            if (c < 0 || c > s->r) return 2;
        }
    }
    const step_bufs b = carve(s);
    #pragma omp parallel for schedule(static) num_threads(s->nthreads) if (s->nthreads > 1)
    for (int64_t n = 0; n < s->n; ++n) prep_seq(s, &b, n);
    const int64_t kd = s->hk * s->dk;
    gdn_args p;
    memset(&p, 0, sizeof p);
    p.pool = s->pool; p.pool_stride = s->pool_stride; p.slots = b.slots;
    p.n = s->n; p.hv = s->hv; p.dv = s->dv; p.dk = s->dk; p.group = s->hv / s->hk; p.q = s->q;
    p.qs = b.q32; p.ks = b.k32; p.v = b.v32; p.beta = b.beta; p.ecum = b.ecum; p.a = b.A; p.b = b.B;
    p.out = s->out; p.out16 = s->out16; p.nthreads = s->nthreads;
    if (s->pending) {
        p.r = s->r; p.n_commit = b.n_commit; p.c_decay = b.c_decay; p.c_coef = b.c_coef; p.c_k = b.c_k;
        p.pend = s->pending + kd; p.pend_slot = s->pend_slot; p.pend_tok = s->pend_tok;
        p.stash = s->pending + kd; p.stash_slot = s->pend_slot; p.stash_tok = s->pend_tok;
    } else {
        p.a_decay = b.a_decay; p.a_coef = b.a_coef;
    }
    gdn_pass(&p);
    return 0;
}
"""
)

MAX_PENDING = 64
"""Most pending tokens per slot (``R``) the step takes."""


class _StepArgs(ctypes.Structure):
    _fields_ = [
        ("tq", ctypes.c_void_p), ("tk", ctypes.c_void_p), ("tv", ctypes.c_void_p),
        ("ga", ctypes.c_void_p), ("gb", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in (
            "q_sn", "q_st", "q_sh", "k_sn", "k_st", "k_sh", "v_sn", "v_st", "v_sh", "ga_sn", "ga_st", "gb_sn",
            "gb_st",
        )),
        ("qk_bf16", ctypes.c_int), ("v_bf16", ctypes.c_int), ("ga_bf16", ctypes.c_int), ("gb_bf16", ctypes.c_int),
        ("a_log", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p),
        ("a_log_bf16", ctypes.c_int), ("dt_bias_bf16", ctypes.c_int),
        ("scale", ctypes.c_float), ("eps", ctypes.c_float), ("l2norm", ctypes.c_int),
        ("slots", ctypes.c_void_p), ("slots64", ctypes.c_int), ("commit", ctypes.c_void_p), ("commit64", ctypes.c_int),
        ("pending", ctypes.c_void_p), ("pend_slot", ctypes.c_int64), ("pend_tok", ctypes.c_int64),
        ("r", ctypes.c_int64), ("pos", ctypes.c_void_p), ("pos_slot", ctypes.c_int64),
        ("pool", ctypes.c_void_p), ("pool_stride", ctypes.c_int64), ("num_slots", ctypes.c_int64),
        ("n", ctypes.c_int64), ("q", ctypes.c_int64), ("hk", ctypes.c_int64), ("hv", ctypes.c_int64),
        ("dk", ctypes.c_int64), ("dv", ctypes.c_int64),
        ("scratch", ctypes.c_void_p), ("out", ctypes.c_void_p), ("out16", ctypes.c_void_p),
        ("nthreads", ctypes.c_int),
    ]  # fmt: skip


@functools.cache
def _library():
    """The compiled ``gdn_step`` (:mod:`.cpu_native`'s pass in the same library; returns an int), or None
    where no C compiler builds it."""
    fn = cpu_native.build(cpu_native._SOURCE + _STEP_SOURCE, "gdn_step", "gdn_step", _StepArgs)
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn


_TOKEN_DTYPES = (torch.float32, torch.bfloat16)


def _unit_last(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in tensors)


def usable(q, k, v, g, beta, ssm_state, pending, A_log, dt_bias, pending_pos) -> bool:
    """Whether :func:`verify_step` (``pending`` given) or :func:`decode_step` (``pending`` None) takes these
    arguments (else the caller keeps its torch preparation): :func:`.cpu_native.usable` for the pool,
    float32 / bf16 tokens, gates and gating weights with a unit last stride, a pending pool whose last dim
    is contiguous with at most :data:`MAX_PENDING` tokens, and a C build."""
    if not cpu_native.usable(ssm_state, q.shape[1]):
        return False
    dtypes = _TOKEN_DTYPES
    if q.dtype not in dtypes or v.dtype not in dtypes or g.dtype not in dtypes or beta.dtype not in dtypes:
        return False
    if not _unit_last(q, k, v, g, beta):
        return False
    if A_log is not None and (
        A_log.dtype not in dtypes or dt_bias.dtype not in dtypes or not _unit_last(A_log, dt_bias)
    ):
        return False
    if pending is not None and (pending.shape[1] > MAX_PENDING or not _unit_last(pending)):
        return False
    if pending_pos is not None and pending_pos.dtype != torch.int32:
        return False
    return _library() is not None


def _step(
    q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm, A_log, dt_bias,
    pending_pos, op,
) -> torch.Tensor:  # fmt: skip
    """One ``gdn_step`` call (a verify with ``pending``, else a decode); ``o [N, Q, Hv, Dv]`` in q's dtype.
    Slot and ``num_commit`` ranges are checked by the C call before it writes anything."""
    fn = _library()
    num_seqs, q_len, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[2], v.shape[3]
    out = torch.empty(num_seqs, q_len, num_v_heads, dv, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    r = 0 if pending is None else pending.shape[1]
    floats = (
        4 * num_seqs  # 2N int64
        + 2 * num_seqs * q_len * num_k_heads * dk
        + num_seqs * q_len * num_v_heads * dv
        + 2 * num_seqs * q_len * num_v_heads
        + 2 * num_seqs * num_v_heads * q_len * q_len
        + num_seqs * num_v_heads
        + num_seqs * r * num_v_heads
        + num_seqs * r * num_k_heads * dk
        + num_seqs * num_v_heads
        + num_seqs * q_len * num_v_heads
    )
    scratch = torch.empty(floats, dtype=torch.float32)
    slots = state_indices if state_indices.is_contiguous() else state_indices.contiguous()
    keep = [scratch, slots]
    bf16 = torch.bfloat16
    args = _StepArgs(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),  # tq .. gb, then the strides
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:2], *beta.stride()[:2],
        qk_bf16=q.dtype == bf16, v_bf16=v.dtype == bf16, ga_bf16=g.dtype == bf16, gb_bf16=beta.dtype == bf16,
        scale=scale, eps=DEFAULT_EPS, l2norm=bool(use_qk_l2norm),
        slots=slots.data_ptr(), slots64=slots.dtype == torch.int64,
        pool=ssm_state.data_ptr(), pool_stride=ssm_state.stride(0), num_slots=ssm_state.shape[0],
        n=num_seqs, q=q_len, hk=num_k_heads, hv=num_v_heads, dk=dk, dv=dv,
        scratch=scratch.data_ptr(), nthreads=torch.get_num_threads(),
    )  # fmt: skip
    if q.dtype == bf16:
        args.out16 = out.data_ptr()
    else:
        args.out = out.data_ptr()
    if A_log is not None:
        args.a_log, args.dt_bias = A_log.data_ptr(), dt_bias.data_ptr()
        args.a_log_bf16, args.dt_bias_bf16 = A_log.dtype == bf16, dt_bias.dtype == bf16
    if pending is not None:
        commit = num_commit if num_commit.is_contiguous() else num_commit.contiguous()
        keep.append(commit)
        args.commit, args.commit64 = commit.data_ptr(), commit.dtype == torch.int64
        args.pending, args.pend_slot, args.pend_tok, args.r = (
            pending.data_ptr(),
            pending.stride(0),
            pending.stride(1),
            r,
        )
    if pending_pos is not None:
        args.pos, args.pos_slot = pending_pos.data_ptr(), pending_pos.stride(0)
    bad = fn(ctypes.byref(args))
    del keep
    if bad:  # the shared checks raise their own messages (nothing was written)
        check_slot_values(op, "state_indices", state_indices, ssm_state.shape[0])
        check_num_accepted_values(op, num_commit, r, f"R={r}", low=0, name="num_commit")
        raise ValueError(f"{op}: state_indices or num_commit out of range (C check {bad})")
    return out


def verify_step(
    q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm, A_log, dt_bias,
    pending_pos,
) -> torch.Tensor:  # fmt: skip
    """:func:`.cpu.gated_delta_rule_verify` (checked shapes and dtypes, :func:`usable`) in one C call, the
    slot and ``num_commit`` ranges included; returns ``o [N, Q, Hv, Dv]`` in q's dtype."""
    return _step(
        q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm, A_log, dt_bias,
        pending_pos, "gated_delta_rule_verify",
    )  # fmt: skip


def decode_step(
    q, k, v, g, beta, ssm_state, state_indices, scale, use_qk_l2norm, A_log, dt_bias
) -> torch.Tensor:
    """:func:`.cpu.gated_delta_rule_recurrent` (checked shapes and dtypes, :func:`usable` with no pending
    pool) in one C call, the slot range included; returns ``o [N, Q, Hv, Dv]`` in q's dtype."""
    return _step(
        q, k, v, g, beta, ssm_state, None, state_indices, None, scale, use_qk_l2norm, A_log, dt_bias, None,
        "gated_delta_rule_recurrent",
    )  # fmt: skip
