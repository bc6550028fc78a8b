"""The cpu backend's causal conv1d update (decode / verify) in one C call.

The torch form (:func:`.cpu.causal_conv1d_update`) is a dozen ops per layer and step (gather of the
windows, a concatenation, ``K`` multiply-adds, the activation, two dtype conversions, the indexed store),
each over only ``N * Q * C`` values: at serving batch sizes their dispatch and temporaries cost more than
the arithmetic. Here one loop over the sequences (split over ``torch.get_num_threads()`` OpenMP threads),
per block of channels, reads the slot's ``K - 1`` history columns from ``num_accepted - 1`` on (zeros for a
padding row) and the ``Q`` new tokens into float32, computes::

    y_j = full_j w_0;  y_j = y_j + full_{j+i} w_i  (i = 1 .. K-1);  y_j = y_j + bias;  silu(y) = y / (1 + e^{-y})

(the torch form's float32 expressions in its order, no contraction into fused multiply-adds; ``e^{-y}`` a
polynomial of its own, about 2e-7 relative error, so the loop vectorises: a call to the C library's
``expf`` per value made the activation 60% of the call), stores the output in the tokens' dtype and
``full[1:]`` left-aligned into the slot's window (real rows only), the history read before any column is
written. The weight and bias are read in their own dtype and layout (converted to float32 once a call),
and the slots and counts are range-checked before anything is written (the torch form's errors). bf16
values are rounded to nearest even as torch rounds them. Built and cached like
:mod:`atom_kernels.ops.gated_delta_rule.cpu_native`.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from atom_kernels.ops._checks import check_num_accepted_values, check_slot_values
from atom_kernels.ops.gated_delta_rule import cpu_native

MAX_COLUMNS = 64
"""Most ``K - 1 + Q`` columns (history and tokens) of one call."""

_SOURCE = (
    r"""
#pragma GCC optimize ("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_COLS 64
#define BLOCK 256

"""
    + cpu_native.EXP_PRELUDE
    + r"""

"""
    + cpu_native.BF16_PRELUDE
    + r"""
typedef struct {
    const void *x; int64_t x_sn, x_st; int x_bf16;        /* [N, Q, C], channel stride 1 */
    const void *w; int64_t w_c, w_k; int w_bf16;           /* [C, K] with its strides */
    const void *bias; int bias_bf16;                       /* [C] contiguous, or NULL */
    void *state; int64_t s_slot, s_ch, s_col; int s_bf16;  /* [S, C, W] with its strides */
    const int32_t *slots; int64_t num_slots, width;       /* [N] slots of the pool [S, C, W] */
    const int32_t *accepted;                               /* [N] or NULL (1) */
    int64_t n, q, c, k;
    int silu;
    void *out; int out_bf16;                               /* [N, Q, C] contiguous */
    int nthreads;
} conv_args;

/* dst[c] = float(src[c * stride]) for c < nb (the dtype branch outside the loop, so each loop vectorises) */
static void row_in(float *restrict dst, const void *src, int64_t off, int64_t stride, int64_t nb, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int64_t c = 0; c < nb; ++c) dst[c] = bf16_to_f32(s[c * stride]);
    } else {
        const float *s = (const float *)src + off;
        for (int64_t c = 0; c < nb; ++c) dst[c] = s[c * stride];
    }
}

static void row_out(void *dst, int64_t off, int64_t stride, const float *restrict src, int64_t nb, int bf16) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst + off;
        for (int64_t c = 0; c < nb; ++c) d[c * stride] = f32_to_bf16(src[c]);
    } else {
        float *d = (float *)dst + off;
        for (int64_t c = 0; c < nb; ++c) d[c * stride] = src[c];
    }
}

/* w: [K, C] and bias: [C] (or NULL) in float32, converted from the arguments once a call by conv_update */
static void conv_seq(const conv_args *p, const float *w, const float *bias, int64_t n) {
    const int64_t Q = p->q, C = p->c, K = p->k, H = K - 1;
    const int64_t slot = p->slots[n];
    const int64_t start = p->accepted ? (int64_t)p->accepted[n] - 1 : 0;
    float full[MAX_COLS][BLOCK], y[BLOCK];
    for (int64_t c0 = 0; c0 < C; c0 += BLOCK) {
        const int64_t nb = C - c0 < BLOCK ? C - c0 : BLOCK;
        for (int64_t i = 0; i < H; ++i) {
            if (slot >= 0)
                row_in(full[i], p->state, slot * p->s_slot + c0 * p->s_ch + (start + i) * p->s_col, p->s_ch, nb, p->s_bf16);
            else
                memset(full[i], 0, nb * sizeof(float));
        }
        for (int64_t j = 0; j < Q; ++j) row_in(full[H + j], p->x, n * p->x_sn + j * p->x_st + c0, 1, nb, p->x_bf16);
        for (int64_t j = 0; j < Q; ++j) {
            const float *w0 = w + c0;
            for (int64_t c = 0; c < nb; ++c) y[c] = full[j][c] * w0[c];
            for (int64_t i = 1; i < K; ++i) {
                const float *wi = w + i * C + c0, *f = full[j + i];
                for (int64_t c = 0; c < nb; ++c) y[c] = y[c] + f[c] * wi[c];
            }
            if (bias)
                for (int64_t c = 0; c < nb; ++c) y[c] = y[c] + bias[c0 + c];
            if (p->silu)
                for (int64_t c = 0; c < nb; ++c) y[c] = y[c] / (1.0f + exp_f32(-y[c]));
            row_out(p->out, (n * Q + j) * C + c0, 1, y, nb, p->out_bf16);
        }
        if (slot >= 0)
            for (int64_t i = 0; i < H - 1 + Q; ++i)
                row_out(p->state, slot * p->s_slot + c0 * p->s_ch + i * p->s_col, p->s_ch, full[i + 1], nb, p->s_bf16);
    }
}

/* 1 where a slot is >= S or a count outside [1, W - K + 2] (nothing written), 2 where out of memory */
int conv_update(const conv_args *p) {
    const int64_t C = p->c, K = p->k;
    for (int64_t n = 0; n < p->n; ++n) {
        if (p->slots[n] >= p->num_slots) return 1;
        if (p->accepted && (p->accepted[n] < 1 || p->accepted[n] > p->width - K + 2)) return 1;
    }
    float *w = malloc((K + 1) * C * sizeof(float)); /* [K, C], then the bias */
    if (!w) return 2;
    for (int64_t i = 0; i < K; ++i) row_in(w + i * C, p->w, i * p->w_k, p->w_c, C, p->w_bf16);
    float *bias = p->bias ? w + K * C : NULL;
    if (bias) row_in(bias, p->bias, 0, 1, C, p->bias_bf16);
    #pragma omp parallel for schedule(static) num_threads(p->nthreads) if (p->nthreads > 1)
    for (int64_t n = 0; n < p->n; ++n) conv_seq(p, w, bias, n);
    free(w);
    return 0;
}
"""
)


class _Args(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("x_sn", ctypes.c_int64), ("x_st", ctypes.c_int64), ("x_bf16", ctypes.c_int),
        ("w", ctypes.c_void_p), ("w_c", ctypes.c_int64), ("w_k", ctypes.c_int64), ("w_bf16", ctypes.c_int),
        ("bias", ctypes.c_void_p), ("bias_bf16", ctypes.c_int),
        ("state", ctypes.c_void_p), ("s_slot", ctypes.c_int64), ("s_ch", ctypes.c_int64),
        ("s_col", ctypes.c_int64), ("s_bf16", ctypes.c_int),
        ("slots", ctypes.c_void_p), ("num_slots", ctypes.c_int64), ("width", ctypes.c_int64),
        ("accepted", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("q", ctypes.c_int64), ("c", ctypes.c_int64), ("k", ctypes.c_int64),
        ("silu", ctypes.c_int), ("out", ctypes.c_void_p), ("out_bf16", ctypes.c_int), ("nthreads", ctypes.c_int),
    ]  # fmt: skip


@functools.cache
def load():
    """The compiled ``conv_update``, or None where no C compiler builds it."""
    fn = cpu_native.build(_SOURCE, "conv_update", "conv_update", _Args)
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn


_DTYPES = (torch.float32, torch.bfloat16)


def usable(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, activation: str | None) -> bool:
    """Whether :func:`conv_update` takes these (checked) arguments: float32 / bf16 tokens, weight and state,
    the tokens' channels contiguous, at most :data:`MAX_COLUMNS` columns, silu or no activation, and a C
    build."""
    if x.dtype not in _DTYPES or conv_state.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        return False
    if x.stride(-1) != 1:
        return False
    if weight.shape[1] - 1 + x.shape[1] > MAX_COLUMNS or activation not in (None, "silu", "swish"):
        return False
    return load() is not None


def conv_update(x, weight, bias, conv_state, state_indices, num_accepted, activation) -> torch.Tensor:
    """:func:`.cpu.causal_conv1d_update` (checked arguments, :func:`usable`) in one C call."""
    num_seqs, q_len, channels = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return out
    slots = state_indices if state_indices.is_contiguous() else state_indices.contiguous()
    bf16 = torch.bfloat16
    args = _Args(
        x=x.data_ptr(), x_sn=x.stride(0), x_st=x.stride(1), x_bf16=x.dtype == bf16, w=weight.data_ptr(),
        w_c=weight.stride(0), w_k=weight.stride(1), w_bf16=weight.dtype == bf16,
        state=conv_state.data_ptr(), s_slot=conv_state.stride(0), s_ch=conv_state.stride(1),
        s_col=conv_state.stride(2), s_bf16=conv_state.dtype == bf16, slots=slots.data_ptr(),
        num_slots=conv_state.shape[0], width=conv_state.shape[2],
        n=num_seqs, q=q_len, c=channels, k=weight.shape[1], silu=activation in ("silu", "swish"),
        out=out.data_ptr(), out_bf16=out.dtype == bf16, nthreads=torch.get_num_threads(),
    )  # fmt: skip
    if bias is not None:
        if bias.dtype not in _DTYPES or not bias.is_contiguous():
            bias = bias.float().contiguous()
        args.bias, args.bias_bf16 = bias.data_ptr(), bias.dtype == bf16
    if num_accepted is not None:
        num_accepted = num_accepted if num_accepted.is_contiguous() else num_accepted.contiguous()
        args.accepted = num_accepted.data_ptr()
    rc = load()(ctypes.byref(args))
    if rc == 1:  # the shared checks raise their own messages (nothing was written)
        limit = conv_state.shape[2] - weight.shape[1] + 2
        check_slot_values("causal_conv1d_update", "state_indices", state_indices, conv_state.shape[0])
        check_num_accepted_values("causal_conv1d_update", num_accepted, limit, f"W - K + 2 = {limit}")
        raise ValueError("causal_conv1d_update: state_indices or num_accepted out of range")
    if rc != 0:
        raise MemoryError("causal_conv1d_update: the C pass could not allocate its weight buffer")
    return out
