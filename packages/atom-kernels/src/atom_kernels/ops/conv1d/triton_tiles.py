"""Triton ``causal_conv1d_update`` tile kernels: each program moves its channels' whole windows as one tile.

The column-wise kernel (``triton._conv_update_kernel``, any strides) reads the window one column at a time,
once per tap and output, and writes the new window column by column. These kernels read each program's
``[channels, W]`` window block once as a register tile, take the history columns out of it in registers
(a masked sum over the window: no exchange between threads where every thread holds its channels' whole
windows), and write the new window as one tile:

- ``_conv_update_tile_kernel``: channel-major state (``[S, C, W]``, a channel's ``W`` columns adjacent:
  8 bytes at W = 4, bf16; the column-wise kernel reads them as loads with lanes 2 bytes apart in every 8):
  a ``[BC, BW]`` tile, one vector load and store per channel.
- ``_conv_update_rows_kernel``: channel-contiguous state (vLLM's ``[S, W, C]`` buffer viewed as
  ``[S, C, W]``): a ``[BW, BC]`` tile of window rows, one channel per lane (each row a coalesced load),
  every thread holding its channels' whole windows.

Semantics, rounding and summation order are the column-wise kernel's: outputs and state bit-equal, but
for the sign of a zero input written to the state (the column-wise kernel adds a masked 0.0 and writes -0.0
as +0.0; these kernels keep -0.0, as the reference does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._pdl import launch_options, pdl_enter

# From CONV_TILE_MIN_TOKENS tokens (N * Q) the tile kernels run. The per-op comparison with stock vLLM
# (docs/performance.md, channel-major state) measured the column-wise kernel ahead of stock up to 16
# tokens and behind from 128, so the column-wise kernel keeps the small sizes until
# benchmarks/gpu/bench_router_conv.py measures the crossover.
CONV_TILE_MIN_TOKENS = 64
# Channels per program of the channel-major tile kernel: 4 per thread at 4 warps (an 80B layer's 8192
# channels in 16 programs per sequence), twice the column-wise kernel's 256, for more bytes in flight.
TILE_BC = 512
# Channels per program of the window-rows kernel: 4 per thread at 4 warps, as the channel-major kernel.
ROWS_BC = 512


@triton.jit
def sequence_columns(hist, o_w_b, off, AXIS: tl.constexpr, p_x, s_xq, m_c, K: tl.constexpr, Q: tl.constexpr):
    """The ``K - 1 + Q`` per-channel values ``history (window entries off .. off + K - 2) ++ x_0..x_{Q-1}``
    as a tuple of float32 vectors: the history taken out of the window tile ``hist`` (window along
    ``AXIS``, ``o_w_b`` its window index broadcastable to it) by a masked sum, each x read once."""
    seq = ()
    for j in tl.static_range(K - 1):
        seq = seq + (tl.sum(tl.where(o_w_b == off + j, hist, 0.0), AXIS),)
    for q in tl.static_range(Q):
        seq = seq + (tl.load(p_x + q * s_xq, mask=m_c, other=0.0).to(tl.float32),)
    return seq


@triton.jit
def outputs(seq, p_w, s_wk, p_b, p_o, s_oq, m_c, K: tl.constexpr, Q: tl.constexpr, HAS_BIAS: tl.constexpr,
            SILU: tl.constexpr):  # fmt: skip
    """``out_q = act(bias + sum_i w_i * seq[q + i])`` stored at ``p_o + q * s_oq``; each tap read once, the
    sum in the column-wise kernel's order (bias, then taps 0 .. K - 1)."""
    ws = ()
    for i in tl.static_range(K):
        ws = ws + (tl.load(p_w + i * s_wk, mask=m_c, other=0.0).to(tl.float32),)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(p_b, mask=m_c, other=0.0).to(tl.float32)
    for q in tl.static_range(Q):
        acc = tl.zeros_like(seq[0])
        if HAS_BIAS:
            acc += bias
        for i in tl.static_range(K):
            acc += seq[q + i] * ws[i]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(p_o + q * s_oq, acc.to(p_o.dtype.element_ty), mask=m_c)


@triton.jit
def _conv_update_tile_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, idx_ptr, acc_ptr, out_ptr, C, s_xn, s_xq, s_xc, s_wc, s_wk, s_ss, s_on,
    s_oq, s_oc, K: tl.constexpr, Q: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """``_conv_update_kernel`` for a channel-major state (``[S, C, W]`` contiguous per slot: a channel's
    ``W`` columns adjacent, channel stride ``W``). The slot's ``[BC, W]`` block is one contiguous range,
    read once as a ``[BC, BW]`` tile (each thread a channel's whole window, a vector load) and written back
    the same way; the history columns come out of the tile in registers (a masked sum over the window).
    ``W`` is a compile-time constant so that the tile's row stride (and its alignment) is known."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    n = tl.program_id(0).to(tl.int64)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    slot = tl.load(idx_ptr + n).to(tl.int64)
    off = 0
    if HAS_ACC:
        off = tl.load(acc_ptr + n) - 1
    # channels whose history is read and written: only a real slot (a bound, not `mask & scalar`: Triton
    # 3.9's interpreter turns a tensor & scalar bool into int32, which tl.load rejects)
    live = o_c < tl.where(slot >= 0, C, 0)
    o_w = tl.arange(0, BW)
    p_s = state_ptr + slot * s_ss + o_c[:, None] * W + o_w[None, :]
    m_s = tl.broadcast_to(live[:, None], [BC, BW])  # uniform along the window: the load stays vectorised
    if W < BW:
        m_s = m_s & (o_w < W)[None, :]
    hist = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    # Per-channel values (x, weights, bias, outputs) go one channel per lane, as the tile's rows do (no
    # vector hint), so that they combine with the history columns taken out of the tile in registers,
    # without an exchange between threads.
    o_l = tl.max_contiguous(o_c, 1)
    seq = sequence_columns(hist, o_w[None, :], off, 1, x_ptr + n * s_xn + o_l * s_xc, s_xq, m_c, K, Q)
    outputs(seq, w_ptr + o_l * s_wc, s_wk, b_ptr + o_l, out_ptr + n * s_on + o_l * s_oc, s_oq, m_c, K, Q,
            HAS_BIAS, SILU)  # fmt: skip
    # new history: seq[1:] left-aligned into columns [0, K - 2 + Q)
    new = tl.zeros([BC, BW], dtype=tl.float32)
    for r in tl.static_range(K - 2 + Q):
        new = tl.where(o_w[None, :] == r, seq[r + 1][:, None], new)
    m_n = tl.broadcast_to(live[:, None], [BC, BW])
    if K - 2 + Q < BW:
        m_n = m_n & (o_w < K - 2 + Q)[None, :]
    tl.debug_barrier()  # all reads of the old history before any write
    tl.store(p_s, new.to(state_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _conv_update_rows_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, idx_ptr, acc_ptr, out_ptr, C, s_xn, s_xq, s_xc, s_wc, s_wk, s_ss, s_sw,
    s_on, s_oq, s_oc, K: tl.constexpr, Q: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """``_conv_update_kernel`` for a channel-contiguous state (channel stride 1, window stride ``s_sw``):
    the window rows ``[BW, BC]`` read once as a tile and written back as one."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    n = tl.program_id(0).to(tl.int64)
    # one channel per lane (no vector hint): the weights ([C, K], channel stride K) then load as a lane
    # per channel, 8 bytes apart, not as a lane per 8 channels, 64 bytes apart (16 cache lines a load)
    o_c = tl.max_contiguous(tl.program_id(1) * BC + tl.arange(0, BC), 1)
    m_c = o_c < C
    slot = tl.load(idx_ptr + n).to(tl.int64)
    off = 0
    if HAS_ACC:
        off = tl.load(acc_ptr + n) - 1
    live = o_c < tl.where(slot >= 0, C, 0)  # a bound, not `mask & scalar` (see _conv_update_tile_kernel)
    o_w = tl.arange(0, BW)
    p_s = state_ptr + slot * s_ss + o_w[:, None] * s_sw + o_c[None, :]
    m_s = tl.broadcast_to(live[None, :], [BW, BC])
    if W < BW:
        m_s = m_s & (o_w < W)[:, None]
    hist = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    seq = sequence_columns(hist, o_w[:, None], off, 0, x_ptr + n * s_xn + o_c * s_xc, s_xq, m_c, K, Q)
    outputs(seq, w_ptr + o_c * s_wc, s_wk, b_ptr + o_c, out_ptr + n * s_on + o_c * s_oc, s_oq, m_c, K, Q,
            HAS_BIAS, SILU)  # fmt: skip
    # new history: seq[1:] left-aligned into rows [0, K - 2 + Q)
    new = tl.zeros([BW, BC], dtype=tl.float32)
    for r in tl.static_range(K - 2 + Q):
        new = tl.where(o_w[:, None] == r, seq[r + 1][None, :], new)
    m_n = tl.broadcast_to(live[None, :], [BW, BC])
    if K - 2 + Q < BW:
        m_n = m_n & (o_w < K - 2 + Q)[:, None]
    tl.debug_barrier()  # all reads of the old history before any write
    tl.store(p_s, new.to(state_ptr.dtype.element_ty), mask=m_n)


def state_layout(conv_state: torch.Tensor) -> str | None:
    """``"channel-major"`` (strides ``(*, W, 1)``), ``"channel-contiguous"`` (channel stride 1, e.g. the
    transpose of an ``[S, W, C]`` buffer) or None (neither: only the column-wise kernel takes it)."""
    width = conv_state.shape[2]
    if conv_state.stride(2) == 1 and conv_state.stride(1) == width:
        return "channel-major"
    if conv_state.stride(1) == 1:
        return "channel-contiguous"
    return None


def update_tiles(
    x, weight, bias, conv_state, state_indices, num_accepted, activation, out, layout: str
) -> None:
    """One launch of the tile kernel for ``layout`` (:func:`state_layout`), arguments as
    ``causal_conv1d_update``'s (checked there), writing ``out``."""
    N, Q, C = x.shape
    K = weight.shape[1]
    W = conv_state.shape[2]
    common = dict(
        K=K, Q=Q, W=W, BW=triton.next_power_of_2(W), HAS_BIAS=bias is not None,
        HAS_ACC=num_accepted is not None, SILU=activation is not None, num_warps=4,
        **launch_options(x.device),
    )  # fmt: skip
    head = (
        x, weight, bias if bias is not None else x, conv_state, state_indices,
        num_accepted if num_accepted is not None else state_indices, out, C,
        x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1), conv_state.stride(0),
    )  # fmt: skip
    tail = (out.stride(0), out.stride(1), out.stride(2))
    if layout == "channel-major":
        _conv_update_tile_kernel[(N, triton.cdiv(C, TILE_BC))](*head, *tail, BC=TILE_BC, **common)
    else:
        _conv_update_rows_kernel[(N, triton.cdiv(C, ROWS_BC))](
            *head, conv_state.stride(2), *tail, BC=ROWS_BC, **common
        )
