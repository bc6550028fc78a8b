"""The cpu backend's routed experts (``moe_experts``) in one C call.

The torch forms of :mod:`.cpu` are a dozen or more ops per call (a sort of the pairs, gathers, two
matmuls per expert or batched, the activation, two dtype conversions, an ``index_add_``): at decode and
verify sizes their dispatch and temporaries cost more than the arithmetic. Here one call does::

    validate the ids (in [-1, E)); list each expert's (token, slot) pairs, in token order
    for each (expert, block of ROWS pairs), over OpenMP threads:
        gather the pairs' tokens; h = xs @ w13[e].T (float32 sums)
        act = silu(h[:, :I]) * h[:, I:] rounded to x.dtype          (the reference's rounding point)
        y_p = (act @ w2[e].T) * weights[p]                           (float32, one row per pair)
    for each token, over threads: out = sum of its held slots' y_p in ascending expert order (slot order
        for a repeated id; -1 slots skipped), from zero in float32, rounded to x.dtype

(the reference's float32 expressions and rounding points; each token's slots summed in the order the
reference's ``index_add_`` per expert sums them, so the result does not depend on the thread count). The
products are float32 sums of x.dtype operands, in one of four forms chosen from the dtypes and shapes:

- float32 weights (a float32 model, or float32 copies of bf16 weights held by their owner): float32
  fused multiply-adds, 16 lanes, each dot product's lanes summed in a fixed pairwise tree;
- bf16 tokens and bf16 weights on a CPU with AMX, H and I multiples of 32: AMX tiles, ``tdpbf16ps`` on
  blocks of 16 outputs x 16 pairs x 32 channels, four blocks in flight (the pairs' channels packed in
  pairs per call, the weights read in place), the process asking the kernel for the tile state (``arch_prctl``) as torch and vLLM do;
- bf16 tokens and bf16 weights elsewhere on a CPU with AVX512-BF16: ``vdpbf16ps``;
  (both: a bf16 x bf16 product is exact in float32, pairs of products accumulate into float32 lanes,
  bf16 subnormals count as zero) so no float32 copy of the weights is needed;
- bf16 weights elsewhere: each weight converted to float32 as it is loaded (exact), then as the first.

``silu(g) = g / (1 + e^{-g})`` with ``e^x`` a polynomial of this module (about 2e-7 relative error, so the
loop vectorises) where torch uses its vectorised ``exp``: the activation may differ from the torch forms'
in the last float32 bit, and so by one x.dtype ulp where that bit decides the rounding.

Built and cached like :mod:`atom_kernels.ops.gated_delta_rule.cpu_native` (no C compiler: the torch
forms run). Tokens with a unit channel stride are read at any row stride (others are copied first);
ids int64 or int32.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from atom_kernels.ops.gated_delta_rule import cpu_native

_SOURCE = (
    r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define ROWS 32   /* pairs of one expert a job */
#define MR 4      /* rows of one register block */
#define NR 4      /* weight rows of one register block */
"""
    + cpu_native.VECTOR_PRELUDE
    + cpu_native.BF16_PRELUDE
    + r"""
#if LANES == 16
/* lane j of the result = the sum of v[j]'s 16 lanes, by a fixed pairwise tree (four halving steps) */
typedef int32_t ivec __attribute__((vector_size(64)));
static inline vec fold(vec a, vec b, ivec lo, ivec hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
static inline vec reduce16(const vec v[16]) {
    const ivec a_lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const ivec a_hi = a_lo + 8;
    const ivec b_lo = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const ivec b_hi = b_lo + 4;
    const ivec c_lo = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const ivec c_hi = c_lo + 2;
    const ivec d_lo = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const ivec d_hi = d_lo + 1;
    vec s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; ++i) s8[i] = fold(v[2 * i], v[2 * i + 1], a_lo, a_hi);
    for (int i = 0; i < 4; ++i) s4[i] = fold(s8[2 * i], s8[2 * i + 1], b_lo, b_hi);
    for (int i = 0; i < 2; ++i) s2[i] = fold(s4[2 * i], s4[2 * i + 1], c_lo, c_hi);
    return fold(s2[0], s2[1], d_lo, d_hi);
}
#endif

/* e^x without a call: 2^k e^r, k = round(x log2 e) (adding and subtracting 1.5 * 2^23), r = x - k ln 2 in
   two parts, e^r a degree-6 polynomial (Taylor coefficients, |r| <= ln2 / 2: relative error about 2e-7);
   inf past 88.72, 0 below -87.33 */
static inline float exp_poly(float x) {
    const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return x > 88.72f ? __builtin_inff() : x < -87.33f ? 0.0f : p * s;
}

typedef struct {
    const void *x; int64_t x_stride; int x_bf16;   /* [T, H], channel stride 1 */
    const float *weights;                          /* [T, K] float32 */
    const int64_t *ids;                            /* [T, K] */
    const void *w13, *w2; int w_bf16;              /* [E, 2I, H], [E, H, I] contiguous */
    int64_t t, k, e, h, inter;
    int64_t *order;                                /* [T K] scratch: pairs sorted by expert */
    int64_t *pos;                                  /* [T K] scratch: each pair's row in y */
    float *y;                                      /* [T K, H] scratch */
    void *out;                                     /* [T, H] contiguous, x's dtype */
    int64_t lo, hi;                                /* out: the ids' range */
    int nthreads;
} moe_args;

#define MUL_FF(a, w) ((a) * (w))
#define MUL_FB(a, w) ((a) * bf16_to_f32(w))
#define MUL_BB(a, w) (bf16_to_f32(a) * bf16_to_f32(w))

/* the block's 16 sums (out[r * NR + o] = a_r . w_o), plus the products of the channels from i on */
#define BLOCK_END(MUL)                                                                                   \
    vec sum = reduce16(acc);                                                                             \
    if (i < kd) {                                                                                        \
        float tail[MR * NR];                                                                             \
        for (int r = 0; r < MR; ++r) for (int o = 0; o < NR; ++o) {                                      \
            float s = 0.0f;                                                                              \
            for (int64_t j = i; j < kd; ++j) s += MUL(a[r][j], w[o][j]);                                 \
            tail[r * NR + o] = s;                                                                        \
        }                                                                                                \
        sum += load(tail);                                                                               \
    }                                                                                                    \
    store(out, sum);

/* one MR x NR register block over kd channels (row pointers), 16 lanes a product */
#define BLOCK(NAME, AT, WT, LOADA, LOADW, MUL)                                                           \
static inline void NAME(const AT *const a[MR], const WT *const w[NR], int64_t kd, float *out) {         \
    vec acc[MR * NR];                                                                                    \
    _Pragma("GCC unroll 16") for (int q = 0; q < MR * NR; ++q) acc[q] = (vec){0};                        \
    int64_t i = 0;                                                                                       \
    for (; i + LANES <= kd; i += LANES) {                                                                \
        vec av[MR];                                                                                      \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; ++r) av[r] = LOADA(a[r] + i);                    \
        _Pragma("GCC unroll 4") for (int o = 0; o < NR; ++o) {                                           \
            const vec wv = LOADW(w[o] + i);                                                              \
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; ++r) acc[r * NR + o] += av[r] * wv;          \
        }                                                                                                \
    }                                                                                                    \
    BLOCK_END(MUL)                                                                                       \
}
#ifdef __AVX512F__
BLOCK(block_ff, float, float, load, load, MUL_FF)
BLOCK(block_fb, float, uint16_t, load, load_bf16, MUL_FB)
#else
/* Without AVX-512 (8-float vectors: AVX2's sixteen registers) a block of 16 accumulators spills. Here the
   block's 16 sums are taken two rows at a time (one row where the next is equal to it or past the block),
   each row's NR dot products in 8 accumulators for a pair of rows, each weight vector loaded once for
   both; a row's sums are the same whichever way it is taken, and a row equal to the previous one (rows
   past m repeat the last) is copied, not recomputed. */
#define BLOCK8(NAME, AT, WT, LOADA, LOADW, MUL)                                                          \
static inline void NAME(const AT *const a[MR], const WT *const w[NR], int64_t kd, float *out) {          \
    for (int r = 0; r < MR;) {                                                                           \
        if (r > 0 && a[r] == a[r - 1]) {                                                                 \
            for (int o = 0; o < NR; ++o) out[r * NR + o] = out[(r - 1) * NR + o];                        \
            ++r;                                                                                         \
            continue;                                                                                    \
        }                                                                                                \
        const int two = r + 1 < MR && a[r + 1] != a[r];                                                  \
        const AT *const a0p = a[r], *const a1p = a[two ? r + 1 : r];                                     \
        vec acc0[NR], acc1[NR];                                                                          \
        _Pragma("GCC unroll 4") for (int o = 0; o < NR; ++o) acc0[o] = acc1[o] = (vec){0};               \
        int64_t i = 0;                                                                                   \
        if (two) {                                                                                       \
            for (; i + LANES <= kd; i += LANES) {                                                        \
                const vec a0 = LOADA(a0p + i), a1 = LOADA(a1p + i);                                      \
                _Pragma("GCC unroll 4") for (int o = 0; o < NR; ++o) {                                   \
                    const vec wv = LOADW(w[o] + i);                                                      \
                    acc0[o] += a0 * wv;                                                                  \
                    acc1[o] += a1 * wv;                                                                  \
                }                                                                                        \
            }                                                                                            \
        } else {                                                                                         \
            for (; i + LANES <= kd; i += LANES) {                                                        \
                const vec a0 = LOADA(a0p + i);                                                           \
                _Pragma("GCC unroll 4") for (int o = 0; o < NR; ++o) acc0[o] += a0 * LOADW(w[o] + i);    \
            }                                                                                            \
        }                                                                                                \
        for (int o = 0; o < NR; ++o) {                                                                   \
            float s0 = lane_sum(acc0[o]), s1 = lane_sum(acc1[o]);                                        \
            for (int64_t j = i; j < kd; ++j) {                                                           \
                s0 += MUL(a0p[j], w[o][j]);                                                              \
                s1 += MUL(a1p[j], w[o][j]);                                                              \
            }                                                                                            \
            out[r * NR + o] = s0;                                                                        \
            if (two) out[(r + 1) * NR + o] = s1;                                                         \
        }                                                                                                \
        r += 1 + two;                                                                                    \
    }                                                                                                    \
}
BLOCK8(block_ff, float, float, load, load, MUL_FF)
BLOCK8(block_fb, float, uint16_t, load, load_bf16, MUL_FB)
#endif

#ifdef __AVX512BF16__
#define HAVE_DPBF16 1
/* bf16 x bf16: vdpbf16ps, 32 channels (pairs of products into 16 float32 lanes) an instruction */
static inline void block_bb(const uint16_t *const a[MR], const uint16_t *const w[NR], int64_t kd, float *out) {
    vec acc[MR * NR];
    _Pragma("GCC unroll 16") for (int q = 0; q < MR * NR; ++q) acc[q] = (vec){0};
    int64_t i = 0;
    for (; i + 2 * LANES <= kd; i += 2 * LANES) {
        __m512bh av[MR];
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; ++r) av[r] = (__m512bh)_mm512_loadu_si512(a[r] + i);
        _Pragma("GCC unroll 4") for (int o = 0; o < NR; ++o) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[o] + i);
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; ++r)
                acc[r * NR + o] = (vec)_mm512_dpbf16_ps((__m512)acc[r * NR + o], av[r], wv);
        }
    }
    BLOCK_END(MUL_BB)
}
#elif defined(__AVX512F__)
#define HAVE_DPBF16 0
BLOCK(block_bb, uint16_t, uint16_t, load_bf16, load_bf16, MUL_BB)
#else
#define HAVE_DPBF16 0
BLOCK8(block_bb, uint16_t, uint16_t, load_bf16, load_bf16, MUL_BB)
#endif

/* c[r * ldc + o] = a_r . w_o for r < m, o < n (rows past the end repeat the last: their results dropped) */
#define GEMM(NAME, BLK, AT, WT)                                                                          \
static void NAME(const AT *a, int64_t lda, int64_t m, const WT *w, int64_t n, int64_t kd,               \
                 float *c, int64_t ldc) {                                                                \
    for (int64_t o0 = 0; o0 < n; o0 += NR) {                                                             \
        const WT *wr[NR];                                                                                \
        for (int o = 0; o < NR; ++o) wr[o] = w + (o0 + o < n ? o0 + o : n - 1) * kd;                     \
        for (int64_t r0 = 0; r0 < m; r0 += MR) {                                                         \
            const AT *ar[MR];                                                                            \
            for (int r = 0; r < MR; ++r) ar[r] = a + (r0 + r < m ? r0 + r : m - 1) * lda;                \
            float blk[MR * NR];                                                                          \
            BLK(ar, wr, kd, blk);                                                                        \
            if (r0 + MR <= m && o0 + NR <= n)                                                            \
                for (int r = 0; r < MR; ++r) memcpy(c + (r0 + r) * ldc + o0, blk + r * NR, NR * 4);     \
            else                                                                                         \
                for (int r = 0; r < MR && r0 + r < m; ++r)                                               \
                    for (int o = 0; o < NR && o0 + o < n; ++o)                                           \
                        c[(r0 + r) * ldc + o0 + o] = blk[r * NR + o];                                    \
        }                                                                                                \
    }                                                                                                    \
}
GEMM(gemm_ff, block_ff, float, float)
GEMM(gemm_fb, block_fb, float, uint16_t)
GEMM(gemm_bb, block_bb, uint16_t, uint16_t)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_cfg;
static int amx_permitted(void) { /* asks the kernel for the tile data state (per process; repeatable) */
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}
static void amx_config(void) { /* eight tiles of 16 rows x 64 bytes, in this thread */
    tile_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}
/* c[r * ldc + o] = a_r . w_o for r < m, o < n (kd a multiple of 32, n of 16), by blocks of c^T of 16 outputs
   x 16 rows: tiles 0-3 (float32, outputs o0 / o0 + 16 x rows r0 / r0 + 16) += tiles 4-5 (16 weight rows x 32
   channels) . tiles 6-7 (16 rows' channel pairs, rows past m zero); four independent sums in flight, each
   over the channels in order. vnni holds kd / 2 x 32 pairs. */
static void gemm_amx(const uint16_t *a, int64_t lda, int64_t m, const uint16_t *w, int64_t n, int64_t kd,
                     float *c, int64_t ldc, uint32_t *vnni) {
    float blk[16][16];
    for (int64_t r0 = 0; r0 < m; r0 += 32) {
        const int64_t mr = m - r0 < 32 ? m - r0 : 32;
        const int two_r = mr > 16;
        for (int64_t t = 0; t < 32; ++t) {
            if (t < mr) {
                const uint16_t *row = a + (r0 + t) * lda;
                for (int64_t kk = 0; kk < kd / 2; ++kk) memcpy(vnni + kk * 32 + t, row + 2 * kk, 4);
            } else {
                for (int64_t kk = 0; kk < kd / 2; ++kk) vnni[kk * 32 + t] = 0;
            }
        }
        for (int64_t o0 = 0; o0 < n; o0 += 32) {
            const int two_o = o0 + 16 < n;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k0 = 0; k0 < kd; k0 += 32) {
                _tile_loadd(4, w + o0 * kd + k0, kd * 2);
                _tile_loadd(6, vnni + k0 / 2 * 32, 128);
                _tile_dpbf16ps(0, 4, 6);
                if (two_r) {
                    _tile_loadd(7, vnni + k0 / 2 * 32 + 16, 128);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_o) {
                    _tile_loadd(5, w + (o0 + 16) * kd + k0, kd * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_r) _tile_dpbf16ps(3, 5, 7);
                }
            }
            for (int q = 0; q < 4; ++q) {
                const int64_t ob = o0 + (q >> 1) * 16, rb = (q & 1) * 16;
                if (ob >= n || rb >= mr) continue;
                switch (q) {
                case 0: _tile_stored(0, blk, 64); break;
                case 1: _tile_stored(1, blk, 64); break;
                case 2: _tile_stored(2, blk, 64); break;
                default: _tile_stored(3, blk, 64); break;
                }
                const int64_t rows = mr - rb < 16 ? mr - rb : 16;
                for (int64_t t = 0; t < rows; ++t)
                    for (int o = 0; o < 16; ++o) c[(r0 + rb + t) * ldc + ob + o] = blk[o][t];
            }
        }
    }
}
#else
#define HAVE_AMX 0
static int amx_permitted(void) { return 0; }
static void amx_config(void) {}
static void gemm_amx(const uint16_t *a, int64_t lda, int64_t m, const uint16_t *w, int64_t n, int64_t kd,
                     float *c, int64_t ldc, uint32_t *vnni) {}
#endif

/* one job: pairs order[s0 .. s0 + n) of expert e; buf holds ROWS * (H + 3I) floats, then the AMX pairs */
static void expert_rows(const moe_args *p, int64_t e, int64_t s0, int64_t n, float *buf, int amx) {
    const int64_t H = p->h, I = p->inter, K = p->k;
    const int bb = p->x_bf16 && p->w_bf16 && (HAVE_DPBF16 || amx); /* bf16 operands straight in */
    uint32_t *vnni = (uint32_t *)(buf + ROWS * (H + 3 * I));
    float *hbuf = buf;                 /* [ROWS, 2I] */
    float *xs = hbuf + ROWS * 2 * I;   /* [ROWS, H] float32, or bf16 in its first half */
    float *act = xs + ROWS * H;        /* [ROWS, I] float32, or bf16 in its first half */
    uint16_t *xs16 = (uint16_t *)xs, *act16 = (uint16_t *)act;
    for (int64_t r = 0; r < n; ++r) {
        const int64_t tok = p->order[s0 + r] / K;
        if (p->x_bf16) {
            const uint16_t *src = (const uint16_t *)p->x + tok * p->x_stride;
            if (bb) memcpy(xs16 + r * H, src, H * 2);
            else for (int64_t c = 0; c < H; ++c) xs[r * H + c] = bf16_to_f32(src[c]);
        } else {
            memcpy(xs + r * H, (const float *)p->x + tok * p->x_stride, H * 4);
        }
    }
    const int64_t w13_off = e * 2 * I * H, w2_off = e * H * I;
    if (amx) gemm_amx(xs16, H, n, (const uint16_t *)p->w13 + w13_off, 2 * I, H, hbuf, 2 * I, vnni);
    else if (bb) gemm_bb(xs16, H, n, (const uint16_t *)p->w13 + w13_off, 2 * I, H, hbuf, 2 * I);
    else if (p->w_bf16) gemm_fb(xs, H, n, (const uint16_t *)p->w13 + w13_off, 2 * I, H, hbuf, 2 * I);
    else gemm_ff(xs, H, n, (const float *)p->w13 + w13_off, 2 * I, H, hbuf, 2 * I);
    for (int64_t r = 0; r < n; ++r) {
        const float *g = hbuf + r * 2 * I, *u = g + I;
        float *ar = act + r * I;
        for (int64_t i = 0; i < I; ++i) ar[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
        if (p->x_bf16) {
            if (bb) for (int64_t i = 0; i < I; ++i) act16[r * I + i] = f32_to_bf16(ar[i]);
            else for (int64_t i = 0; i < I; ++i) ar[i] = bf16_to_f32(f32_to_bf16(ar[i]));
        }
    }
    float *y = p->y + s0 * H;
    if (amx) gemm_amx(act16, I, n, (const uint16_t *)p->w2 + w2_off, H, I, y, H, vnni);
    else if (bb) gemm_bb(act16, I, n, (const uint16_t *)p->w2 + w2_off, H, I, y, H);
    else if (p->w_bf16) gemm_fb(act, I, n, (const uint16_t *)p->w2 + w2_off, H, I, y, H);
    else gemm_ff(act, I, n, (const float *)p->w2 + w2_off, H, I, y, H);
    for (int64_t r = 0; r < n; ++r) {
        const float wt = p->weights[p->order[s0 + r]];
        for (int64_t c = 0; c < H; ++c) y[r * H + c] *= wt;
    }
}

/* out[t] = the sum of token t's held slots' rows of y, in ascending (expert, slot) order */
static void token_sum(const moe_args *p, int64_t t, float *acc) {
    const int64_t H = p->h, K = p->k;
    int64_t slot[K > 0 ? K : 1];
    int64_t m = 0;
    for (int64_t j = 0; j < K; ++j) {
        const int64_t id = p->ids[t * K + j];
        if (id < 0) continue;
        int64_t q = m++;
        while (q > 0 && p->ids[t * K + slot[q - 1]] > id) { slot[q] = slot[q - 1]; --q; }
        slot[q] = j;
    }
    for (int64_t c = 0; c < H; ++c) acc[c] = 0.0f;
    for (int64_t q = 0; q < m; ++q) {
        const float *y = p->y + p->pos[t * K + slot[q]] * H;
        for (int64_t c = 0; c < H; ++c) acc[c] += y[c];
    }
    if (p->x_bf16) {
        uint16_t *o = (uint16_t *)p->out + t * H;
        for (int64_t c = 0; c < H; ++c) o[c] = f32_to_bf16(acc[c]);
    } else {
        memcpy((float *)p->out + t * H, acc, H * 4);
    }
}

int moe_experts(moe_args *p) {
    const int64_t pairs = p->t * p->k, E = p->e, H = p->h, I = p->inter;
    int64_t lo = 0, hi = 0;
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t id = p->ids[i];
        if (i == 0 || id < lo) lo = id;
        if (i == 0 || id > hi) hi = id;
    }
    p->lo = lo;
    p->hi = hi;
    if (pairs && (lo < -1 || hi >= E)) return 1;
    int64_t *first = calloc(E + 1, sizeof(int64_t));          /* each expert's first row of order */
    int64_t *job_first = malloc((E + 1) * sizeof(int64_t));   /* each expert's first job */
    if (!first || !job_first) { free(first); free(job_first); return 2; }
    for (int64_t i = 0; i < pairs; ++i) if (p->ids[i] >= 0) ++first[p->ids[i] + 1];
    job_first[0] = 0;
    for (int64_t e = 0; e < E; ++e) {
        job_first[e + 1] = job_first[e] + (first[e + 1] + ROWS - 1) / ROWS;
        first[e + 1] += first[e];
    }
    int64_t *fill = malloc((E > 0 ? E : 1) * sizeof(int64_t));
    if (!fill) { free(first); free(job_first); return 2; }
    memcpy(fill, first, E * sizeof(int64_t));
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t id = p->ids[i];
        if (id >= 0) { p->pos[i] = fill[id]; p->order[fill[id]++] = i; }
    }
    free(fill);
    const int64_t jobs = job_first[E];
    /* AMX tiles for bf16 x bf16 where the shapes fit them (H and I multiples of 32) */
    const int amx = HAVE_AMX && p->x_bf16 && p->w_bf16 && H % 32 == 0 && I % 32 == 0 && amx_permitted();
    const int64_t floats = ROWS * (H + 3 * I) + 16 * (H > I ? H : I) + H;
    int failed = 0;
    #pragma omp parallel num_threads(p->nthreads) if (p->nthreads > 1)
    {
        float *buf = malloc(floats * sizeof(float));
        if (amx) amx_config();
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < jobs; ++j) {
            if (!buf) continue;
            int64_t e = 0;
            while (job_first[e + 1] <= j) ++e;
            const int64_t s0 = first[e] + (j - job_first[e]) * ROWS;
            const int64_t n = first[e + 1] - s0 < ROWS ? first[e + 1] - s0 : ROWS;
            expert_rows(p, e, s0, n, buf, amx);
        }
        #if HAVE_AMX
        if (amx) _tile_release();
        #endif
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < p->t; ++t) if (buf) token_sum(p, t, buf + floats - H);
        free(buf);
    }
    free(first);
    free(job_first);
    return failed ? 2 : 0;
}

int moe_has_dpbf16(void) { return HAVE_DPBF16; }
"""
)


class _Args(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64), ("x_bf16", ctypes.c_int),
        ("weights", ctypes.c_void_p), ("ids", ctypes.c_void_p),
        ("w13", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("w_bf16", ctypes.c_int),
        ("t", ctypes.c_int64), ("k", ctypes.c_int64), ("e", ctypes.c_int64), ("h", ctypes.c_int64),
        ("inter", ctypes.c_int64), ("order", ctypes.c_void_p), ("pos", ctypes.c_void_p),
        ("y", ctypes.c_void_p), ("out", ctypes.c_void_p), ("lo", ctypes.c_int64), ("hi", ctypes.c_int64),
        ("nthreads", ctypes.c_int),
    ]  # fmt: skip


@functools.cache
def load():
    """The compiled ``moe_experts`` function, or None where no C compiler builds it."""
    fn = cpu_native.build(_SOURCE, "moe_experts", "moe_experts", _Args)
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn


@functools.cache
def has_dpbf16() -> bool:
    """Whether the build multiplies bf16 tokens by bf16 weights with AVX512-BF16's ``vdpbf16ps``."""
    if load() is None:
        return False
    fn = cpu_native.build(_SOURCE, "moe_experts", "moe_has_dpbf16", _Args)  # the same cached library
    fn.argtypes, fn.restype = [], ctypes.c_int
    return bool(fn())


_DTYPES = (torch.float32, torch.bfloat16)


def usable(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether :func:`moe_experts` takes these operands: CPU, float32 or bf16 tokens, float32 or bf16
    weights, and a C build."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and w13.dtype in _DTYPES and load() is not None


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The pass of the module docstring (operands checked by the caller; :func:`usable`); raises
    ValueError for ids outside ``[-1, E)``."""
    tokens, top_k = ids.shape
    num_experts, two_i, hidden = w13.shape
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    # no-op conversions are skipped by a test here: each torch call costs about a microsecond at decode sizes
    if x.stride(1) != 1:
        x = x.contiguous()
    if not w13.is_contiguous():
        w13 = w13.contiguous()
    if not w2.is_contiguous():
        w2 = w2.contiguous()
    if ids.dtype != torch.int64 or not ids.is_contiguous():
        ids = ids.to(torch.int64).contiguous()
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    pairs = tokens * top_k
    index = torch.empty(2 * pairs, dtype=torch.int64)  # order, then pos
    y = torch.empty(pairs, hidden, dtype=torch.float32)
    order = index.data_ptr()
    args = _Args(  # the fields in order
        x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, weights.data_ptr(), ids.data_ptr(),
        w13.data_ptr(), w2.data_ptr(), w13.dtype == torch.bfloat16, tokens, top_k, num_experts, hidden,
        two_i // 2, order, order + 8 * pairs, y.data_ptr(), out.data_ptr(), 0, 0, torch.get_num_threads(),
    )  # fmt: skip
    rc = load()(ctypes.byref(args))
    if rc == 1:
        raise ValueError(
            f"moe_experts: ids must lie in [-1, E={num_experts}), got values in [{args.lo}, {args.hi}]"
        )
    if rc != 0:
        raise MemoryError("moe_experts: the C pass could not allocate its buffers")
    return out
