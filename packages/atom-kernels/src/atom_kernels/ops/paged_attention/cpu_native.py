"""The cpu backend's paged attention for sequences with few new queries (decode, MTP verify), in C.

For each sequence ``n`` with ``1 <= q_len <= MAX_Q`` new queries and each KV head ``h`` (one OpenMP job,
the ``N * Hkv`` jobs split over ``torch.get_num_threads()`` threads), the ``q_len * group`` query rows of
that KV head are converted to float32 once, then the sequence's block table is walked in tiles of
``TILE`` key positions (the next tile's rows prefetched meanwhile): each key and value row is read once
from the cache in place (any block / token / head strides, unit last stride; float32, bf16, or e4m3 times
its per-tensor scale, all converted exactly to float32), each key scored against every query row that sees
it (causal: key position <= query position; four keys per pass over a query row), and the tile's values
accumulated under an online softmax in float32 (per row: running max, rescale by ``e^{old max - new max}``,
running sum; the row's accumulator held in registers over the tile's values). The output ``acc / sum`` is
written in q's dtype (bf16 rounded to nearest even, as torch rounds). The same float32 math as the
reference up to the order of the sums and the exponential (a polynomial, relative error about 2e-7, so the
tile's loop vectorises); no fast-math flag.

The pass reads ``query_start_loc``, ``seq_lens`` and the block table itself (no host list of them is
built) and checks them first (the reference's value checks, plus block ids inside the cache): on a bad
value it writes nothing and the caller raises. It zeroes the rows past ``query_start_loc[N]`` and skips
the sequences with more than ``MAX_Q`` queries, returning how many it skipped, for the caller's torch path.
Built and cached like :mod:`atom_kernels.ops.gated_delta_rule.cpu_native` (its :func:`build`); where no C
compiler builds it, :func:`load` returns None and the backend keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from atom_kernels.ops.gated_delta_rule import cpu_native as _native
from atom_kernels.ops.paged_attention.checks import check_paged_attention_values

MAX_Q = 16
"""Most new queries of a sequence the C pass takes (longer prompt chunks take the torch path)."""

_CACHE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}

_SOURCE = (
    r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 32
"""
    + _native.VECTOR_PRELUDE
    + _native.BF16_PRELUDE
    + r"""
typedef struct {
    const void *q; int64_t q_tok, q_head;          /* [T, Hq, D], unit last stride */
    const void *kc, *vc;                            /* [B, block_size, Hkv, D], unit last stride */
    int64_t k_blk, k_tok, k_head, v_blk, v_tok, v_head;
    int cache_kind;                                 /* 0 float32, 1 bf16, 2 e4m3fn */
    const float *k_scale, *v_scale;                 /* e4m3fn: per-tensor scales */
    const int32_t *tables; int64_t max_blocks;      /* [N, max_blocks] contiguous */
    const int32_t *seq_lens, *qsl;                  /* [N], [N + 1] contiguous */
    int64_t n, t, hq, hkv, d, block_size, num_blocks, max_q;
    float scale;
    int bf16_io;                                    /* q and out: 1 bf16, 0 float32 */
    void *out; int64_t o_tok, o_head;               /* [T, Hq, D], unit last stride */
    int nthreads;
    int64_t num_long;                               /* set: sequences with more than max_q queries */
    int64_t bad;                                    /* set: 0, 1 + the first sequence failing a check, or
                                                       -1 where a thread had no workspace */
} attn_args;

"""
    + _native.EXP_PRELUDE
    + r"""

static float e4m3_to_f32(uint8_t b) { /* exact: sign, 4 exponent bits (bias 7), 3 mantissa bits */
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = ldexpf((float)m, -9);
    else v = ldexpf((float)(8 + m), e - 10);
    return (b & 0x80) ? -v : v;
}

/* row c < d of a cache / q element pointer as float32, into dst (or the row itself for float32) */
static inline const float *row_f32(const void *base, int64_t off, int kind, int64_t d, const float *fp8,
                                   float scale, float *dst) {
    if (kind == 0) return (const float *)base + off;
    if (kind == 1) {
        const uint16_t *s = (const uint16_t *)base + off;
        int64_t c = 0;
        for (; c + LANES <= d; c += LANES) store(dst + c, load_bf16(s + c));
        for (; c < d; ++c) dst[c] = bf16_to_f32(s[c]);
    } else {
        const uint8_t *s = (const uint8_t *)base + off;
        for (int64_t c = 0; c < d; ++c) dst[c] = fp8[s[c]] * scale;
    }
    return dst;
}

/* s[j] = (q . k_j) * scale for j < nk: four keys at a time (four independent sums), each sum 16 lanes then
   the lane tree, plus the tail past the last whole vector */
static inline void scores(const float *q, const float *const *k, int64_t nk, int64_t d, float scale, float *s) {
    const int64_t dv = d - d % LANES;
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4) {
        vec a0 = (vec){0}, a1 = (vec){0}, a2 = (vec){0}, a3 = (vec){0};
        for (int64_t c = 0; c < dv; c += LANES) {
            const vec x = load(q + c);
            a0 += x * load(k[j] + c);
            a1 += x * load(k[j + 1] + c);
            a2 += x * load(k[j + 2] + c);
            a3 += x * load(k[j + 3] + c);
        }
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t c = dv; c < d; ++c)
            for (int i = 0; i < 4; ++i) t[i] += q[c] * k[j + i][c];
        s[j] = (lane_sum(a0) + t[0]) * scale;
        s[j + 1] = (lane_sum(a1) + t[1]) * scale;
        s[j + 2] = (lane_sum(a2) + t[2]) * scale;
        s[j + 3] = (lane_sum(a3) + t[3]) * scale;
    }
    for (; j < nk; ++j) {
        vec a0 = (vec){0};
        for (int64_t c = 0; c < dv; c += LANES) a0 += load(q + c) * load(k[j] + c);
        float t = 0.0f;
        for (int64_t c = dv; c < d; ++c) t += q[c] * k[j][c];
        s[j] = (lane_sum(a0) + t) * scale;
    }
}

/* a += sum_{j < nv} w_j v_j, a's chunk of 8 vectors held in registers over the keys */
static inline void accumulate(float *a, const float *w, const float *const *v, int64_t nv, int64_t d) {
    int64_t c = 0;
    for (; c + 8 * LANES <= d; c += 8 * LANES) {
        vec x[8];
        for (int i = 0; i < 8; ++i) x[i] = load(a + c + i * LANES);
        for (int64_t j = 0; j < nv; ++j) {
            const float *vj = v[j] + c;
            for (int i = 0; i < 8; ++i) x[i] += w[j] * load(vj + i * LANES);
        }
        for (int i = 0; i < 8; ++i) store(a + c + i * LANES, x[i]);
    }
    for (; c + LANES <= d; c += LANES) {
        vec x = load(a + c);
        for (int64_t j = 0; j < nv; ++j) x += w[j] * load(v[j] + c);
        store(a + c, x);
    }
    for (; c < d; ++c) {
        float x = a[c];
        for (int64_t j = 0; j < nv; ++j) x += w[j] * v[j][c];
        a[c] = x;
    }
}

/* one job: sequence job / Hkv, KV head job % Hkv; d a constant in the specialised copies below */
static inline __attribute__((always_inline)) void attend_d(const attn_args *p, int64_t job, float *ws,
                                                           const float *fp8, const int64_t d) {
    const int64_t n = job / p->hkv, h = job % p->hkv;
    const int64_t qs = p->qsl[n], len = p->qsl[n + 1] - qs, seq = p->seq_lens[n];
    if (len == 0 || len > p->max_q) return;
    const int64_t g = p->hq / p->hkv, rows = len * g, bs = p->block_size;
    float *qf = ws, *acc = qf + rows * d, *kt = acc + rows * d, *vt = kt + TILE * d;
    float *sc = vt + TILE * d, *mx = sc + TILE, *sum = mx + rows;
    const float ks = p->cache_kind == 2 ? *p->k_scale : 1.0f, vs = p->cache_kind == 2 ? *p->v_scale : 1.0f;
    const int32_t *table = p->tables + n * p->max_blocks;
    const int64_t item = p->cache_kind == 0 ? 4 : p->cache_kind == 1 ? 2 : 1;
    for (int64_t r = 0; r < rows; ++r) { /* row r: query r / g, head h * g + r % g */
        const int64_t off = (qs + r / g) * p->q_tok + (h * g + r % g) * p->q_head;
        const float *src = row_f32(p->q, off, p->bf16_io, d, fp8, 1.0f, qf + r * d);
        if (src != qf + r * d) memcpy(qf + r * d, src, d * sizeof(float));
        memset(acc + r * d, 0, d * sizeof(float));
        mx[r] = -INFINITY;
        sum[r] = 0.0f;
    }
    const float *krow[TILE], *vrow[TILE];
    for (int64_t t0 = 0; t0 < seq; t0 += TILE) {
        const int64_t nt = seq - t0 < TILE ? seq - t0 : TILE;
        for (int64_t j = 0; j < nt; ++j) { /* the tile's key and value rows, each read once */
            const int64_t pos = t0 + j, blk = table[pos / bs], o = pos % bs;
            if (pos + TILE < seq) { /* the same row of the next tile on its way */
                const int64_t nb = table[(pos + TILE) / bs], no = (pos + TILE) % bs;
                const char *k = (const char *)p->kc + (nb * p->k_blk + no * p->k_tok + h * p->k_head) * item;
                const char *v = (const char *)p->vc + (nb * p->v_blk + no * p->v_tok + h * p->v_head) * item;
                for (int64_t b = 0; b < d * item; b += 64) {
                    __builtin_prefetch(k + b);
                    __builtin_prefetch(v + b);
                }
            }
            krow[j] = row_f32(p->kc, blk * p->k_blk + o * p->k_tok + h * p->k_head, p->cache_kind, d, fp8,
                              ks, kt + j * d);
            vrow[j] = row_f32(p->vc, blk * p->v_blk + o * p->v_tok + h * p->v_head, p->cache_kind, d, fp8,
                              vs, vt + j * d);
        }
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t last = seq - len + r / g; /* the query's position: it sees keys 0 .. last */
            const int64_t nv = last - t0 + 1 < nt ? last - t0 + 1 : nt;
            if (nv <= 0) continue;
            scores(qf + r * d, krow, nv, d, p->scale, sc);
            float tmax = -INFINITY;
            for (int64_t j = 0; j < nv; ++j) tmax = sc[j] > tmax ? sc[j] : tmax;
            const float m = tmax > mx[r] ? tmax : mx[r];
            if (m == -INFINITY) continue; /* every score so far -inf: nothing to add */
            float *a = acc + r * d;
            if (m != mx[r]) {
                const float corr = exp_f32(mx[r] - m);
                sum[r] *= corr;
                for (int64_t c = 0; c < d; ++c) a[c] *= corr;
                mx[r] = m;
            }
            float tsum = 0.0f;
            for (int64_t j = 0; j < nv; ++j) sc[j] = exp_f32(sc[j] - m);
            for (int64_t j = 0; j < nv; ++j) tsum += sc[j];
            sum[r] += tsum;
            accumulate(a, sc, vrow, nv, d);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t off = (qs + r / g) * p->o_tok + (h * g + r % g) * p->o_head;
        const float *a = acc + r * d, total = sum[r];
        if (p->bf16_io) {
            uint16_t *o = (uint16_t *)p->out + off;
            for (int64_t c = 0; c < d; ++c) o[c] = f32_to_bf16(a[c] / total);
        } else {
            float *o = (float *)p->out + off;
            for (int64_t c = 0; c < d; ++c) o[c] = a[c] / total;
        }
    }
}

static void attend_64(const attn_args *p, int64_t job, float *ws, const float *fp8) { attend_d(p, job, ws, fp8, 64); }
static void attend_128(const attn_args *p, int64_t job, float *ws, const float *fp8) { attend_d(p, job, ws, fp8, 128); }
static void attend_256(const attn_args *p, int64_t job, float *ws, const float *fp8) { attend_d(p, job, ws, fp8, 256); }
static void attend_any(const attn_args *p, int64_t job, float *ws, const float *fp8) { attend_d(p, job, ws, fp8, p->d); }

static int64_t check(const attn_args *p) { /* 0, or 1 + the first sequence with a bad value */
    if (p->n > 0 && p->qsl[0] < 0) return 1;
    for (int64_t n = 0; n < p->n; ++n) {
        const int64_t len = (int64_t)p->qsl[n + 1] - p->qsl[n], seq = p->seq_lens[n];
        if (len < 0 || p->qsl[n + 1] > p->t || seq < len) return n + 1;
        const int64_t blocks = (seq + p->block_size - 1) / p->block_size;
        if (blocks > p->max_blocks) return n + 1;
        if (len == 0 || len > p->max_q) continue;
        for (int64_t b = 0; b < blocks; ++b) {
            const int32_t blk = p->tables[n * p->max_blocks + b];
            if (blk < 0 || blk >= p->num_blocks) return n + 1;
        }
    }
    return 0;
}

void paged_attention_pass(attn_args *p) {
    p->bad = check(p);
    p->num_long = 0;
    if (p->bad) return;
    for (int64_t n = 0; n < p->n; ++n) p->num_long += p->qsl[n + 1] - p->qsl[n] > p->max_q;
    const int64_t end = p->n > 0 ? p->qsl[p->n] : 0, item = p->bf16_io ? 2 : 4;
    for (int64_t t = end; t < p->t; ++t) /* padding rows: zeros */
        for (int64_t hd = 0; hd < p->hq; ++hd)
            memset((char *)p->out + (t * p->o_tok + hd * p->o_head) * item, 0, p->d * item);
    float fp8[256];
    if (p->cache_kind == 2)
        for (int i = 0; i < 256; ++i) fp8[i] = e4m3_to_f32((uint8_t)i);
    const int64_t jobs = p->n * p->hkv, rows = p->max_q * (p->hq / p->hkv), d = p->d;
    const size_t floats = (size_t)(2 * rows * d + 2 * TILE * d + TILE + 2 * rows + 16);
    void (*attend)(const attn_args *, int64_t, float *, const float *) =
        d == 64 ? attend_64 : d == 128 ? attend_128 : d == 256 ? attend_256 : attend_any;
    #pragma omp parallel num_threads(p->nthreads) if (p->nthreads > 1 && jobs > 1)
    {
        float *ws = malloc(floats * sizeof(float));
        #pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; ++job) {
            if (ws) attend(p, job, ws, fp8);
            else p->bad = -1; /* no workspace: reported, nothing computed */
        }
        free(ws);
    }
}
"""
)


class _Args(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("q_tok", ctypes.c_int64), ("q_head", ctypes.c_int64),
        ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p),
        ("k_blk", ctypes.c_int64), ("k_tok", ctypes.c_int64), ("k_head", ctypes.c_int64),
        ("v_blk", ctypes.c_int64), ("v_tok", ctypes.c_int64), ("v_head", ctypes.c_int64),
        ("cache_kind", ctypes.c_int), ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
        ("tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p), ("qsl", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("t", ctypes.c_int64), ("hq", ctypes.c_int64), ("hkv", ctypes.c_int64),
        ("d", ctypes.c_int64), ("block_size", ctypes.c_int64), ("num_blocks", ctypes.c_int64),
        ("max_q", ctypes.c_int64), ("scale", ctypes.c_float), ("bf16_io", ctypes.c_int),
        ("out", ctypes.c_void_p), ("o_tok", ctypes.c_int64), ("o_head", ctypes.c_int64),
        ("nthreads", ctypes.c_int), ("num_long", ctypes.c_int64), ("bad", ctypes.c_int64),
    ]  # fmt: skip


@functools.cache
def load():
    """The compiled ``paged_attention_pass``, or None where no C compiler builds it."""
    return _native.build(_SOURCE, "paged_attention_pass", "paged_attention_pass", _Args)


def usable(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether :func:`attend` takes these inputs (already through ``check_paged_attention``): CPU
    tensors, q float32 or bf16, caches with a unit last stride, and a C build."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    if key_cache.dtype not in _CACHE_KIND or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        return False
    return load() is not None


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def attend(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, ks, vs, out) -> int:
    """The pass of the module docstring into ``out`` (unit last stride): the rows of every sequence with
    at most :data:`MAX_Q` queries, and zeros past ``query_start_loc[N]``. ``ks``, ``vs``: the 0-d float32
    scales (read for fp8 caches only).

    Returns:
        How many sequences have more than :data:`MAX_Q` queries (their rows are left for the caller).

    Raises:
        ValueError: where the indices fail the reference's value checks or name a block outside the cache.
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    keep = [tables := _ints(block_tables), lens := _ints(seq_lens), starts := _ints(query_start_loc)]
    keep += [ks := ks.contiguous(), vs := vs.contiguous()]
    kind = _CACHE_KIND[key_cache.dtype]
    args = _Args(
        q=q.data_ptr(), q_tok=q.stride(0), q_head=q.stride(1),
        kc=key_cache.data_ptr(), vc=value_cache.data_ptr(),
        k_blk=key_cache.stride(0), k_tok=key_cache.stride(1), k_head=key_cache.stride(2),
        v_blk=value_cache.stride(0), v_tok=value_cache.stride(1), v_head=value_cache.stride(2),
        cache_kind=kind, k_scale=ks.data_ptr(), v_scale=vs.data_ptr(),
        tables=tables.data_ptr(), max_blocks=tables.shape[1], seq_lens=lens.data_ptr(),
        qsl=starts.data_ptr(), n=lens.shape[0], t=q.shape[0], hq=q.shape[1], hkv=num_kv_heads,
        d=head_dim, block_size=block_size, num_blocks=num_blocks, max_q=MAX_Q, scale=scale,
        bf16_io=int(q.dtype == torch.bfloat16), out=out.data_ptr(), o_tok=out.stride(0),
        o_head=out.stride(1), nthreads=torch.get_num_threads(),
    )  # fmt: skip
    load()(ctypes.byref(args))
    del keep  # the contiguous copies lived through the call
    if args.bad < 0:
        raise MemoryError("paged_attention: the C pass could not allocate its per-thread workspace")
    if args.bad:
        check_paged_attention_values(block_tables, seq_lens, query_start_loc, block_size, q.shape[0])
        n = args.bad - 1
        raise ValueError(
            f"paged_attention: sequence {n} (query_start_loc {query_start_loc[n : n + 2].tolist()}, "
            f"seq_len {int(seq_lens[n])}) has indices outside the contract or blocks outside the cache's "
            f"{num_blocks} blocks"
        )
    return int(args.num_long)
