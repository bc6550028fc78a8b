"""Triton causal depthwise conv1d: varlen prefill with initial/final states, and the 1 + k update.

State layout ``conv_state[S, C, W]`` with any strides (vLLM passes the transpose of its ``[S, W, C]``
buffer); semantics as the reference (docs/kernel-api.md): the valid history is the ``K - 1`` columns
starting at ``num_accepted - 1``; slots < 0 read zeros and write nothing.

- ``causal_conv1d_varlen``: programs over (token block, channel block) of the flat batch; a token finds
  its sequence by counting ``cu_seqlens`` ends (no host sync, no per-sequence grid). Taps that fall before
  the sequence start read the initial history. A second launch writes each sequence's last ``K - 1``
  inputs (taken from the old history for sequences shorter than that), so no program overwrites a
  history another program still reads.
- ``causal_conv1d_update``: one program per (sequence, channel block) reads the history and the Q new
  inputs, writes the Q outputs and the shifted window ``(history ++ x)[1:]`` left-aligned. A barrier
  separates the reads of the old window from the in-place writes. The tile kernels of ``triton_tiles`` do
  the same with each program's windows read and written once as a register tile (the default for a
  channel-major state from ``CONV_TILE_MIN_TOKENS`` tokens; ``variant=`` picks either).

Value checks (``cu_seqlens`` from 0 to T, slot and ``num_accepted`` ranges; ``atom_kernels.ops._checks``)
read the data, so they run only for CPU tensors (Triton's interpreter): on a GPU they would synchronise
the device on every call. Math in float32, outputs in x.dtype. Only ``tl`` primitives (``tl.debug_barrier`` is a CTA barrier on
both CUDA and ROCm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._checks import check_cu_seqlens_values, check_num_accepted_values, check_slot_values
from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.conv1d.checks import check_causal_conv1d_update, check_causal_conv1d_varlen
from atom_kernels.ops.conv1d.triton_tiles import CONV_TILE_MIN_TOKENS, state_layout, update_tiles


@triton.jit
def _conv_varlen_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    cu_ptr,
    state_ptr,
    idx_ptr,
    init_ptr,
    out_ptr,
    T,
    N,
    C,
    s_xt,
    s_xc,
    s_wc,
    s_wk,
    s_ss,
    s_sc,
    s_sw,
    s_ot,
    s_oc,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    o_t = pid_t * BT + tl.arange(0, BT)
    o_c = pid_c * BC + tl.arange(0, BC)
    m_t = o_t < T
    m_c = o_c < C
    # sequence of each token = number of sequence ends <= token (cu_seqlens[1:] is sorted)
    seq = tl.zeros([BT], dtype=tl.int32)
    for n0 in range(0, N, BN):
        o_n = n0 + tl.arange(0, BN)
        ends = tl.load(cu_ptr + 1 + o_n, mask=o_n < N, other=2147483647)
        seq += tl.sum((ends[None, :] <= o_t[:, None]).to(tl.int32), 1)
    seq = tl.minimum(seq, N - 1)
    start = tl.load(cu_ptr + seq, mask=m_t, other=0)
    slot = tl.load(idx_ptr + seq, mask=m_t, other=-1).to(tl.int64)
    init = tl.load(init_ptr + seq, mask=m_t, other=0) != 0
    use_h = init & (slot >= 0)
    mc2 = m_t[:, None] & m_c[None, :]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(K):
        src = o_t - (K - 1) + i
        in_seq = src >= start
        xv = tl.load(
            x_ptr + src.to(tl.int64)[:, None] * s_xt + o_c[None, :] * s_xc,
            mask=mc2 & in_seq[:, None],
            other=0.0,
        ).to(tl.float32)
        hcol = (K - 1) - (start - src)
        hv = tl.load(
            state_ptr + slot[:, None] * s_ss + o_c[None, :] * s_sc + hcol[:, None] * s_sw,
            mask=mc2 & (~in_seq & use_h)[:, None],
            other=0.0,
        ).to(tl.float32)
        wi = tl.load(w_ptr + o_c * s_wc + i * s_wk, mask=m_c, other=0.0).to(tl.float32)
        acc += (xv + hv) * wi[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + o_t.to(tl.int64)[:, None] * s_ot + o_c[None, :] * s_oc,
        acc.to(out_ptr.dtype.element_ty),
        mask=mc2,
    )


@triton.jit
def _conv_varlen_state_kernel(
    x_ptr,
    cu_ptr,
    state_ptr,
    idx_ptr,
    init_ptr,
    C,
    s_xt,
    s_xc,
    s_ss,
    s_sc,
    s_sw,
    K: tl.constexpr,
    BW: tl.constexpr,
    BC: tl.constexpr,
):
    """Final history of sequence n: the last K - 1 inputs (older ones from the initial history)."""
    n = tl.program_id(0)
    pid_c = tl.program_id(1)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot >= 0:
        start = tl.load(cu_ptr + n)
        end = tl.load(cu_ptr + n + 1)
        init = tl.load(init_ptr + n) != 0
        o_w = tl.arange(0, BW)
        o_c = pid_c * BC + tl.arange(0, BC)
        m = (o_w < K - 1)[:, None] & (o_c < C)[None, :]
        src = end - (K - 1) + o_w
        from_x = src >= start
        xv = tl.load(
            x_ptr + src.to(tl.int64)[:, None] * s_xt + o_c[None, :] * s_xc,
            mask=m & from_x[:, None],
            other=0.0,
        )
        hcol = o_w + (end - start)
        p_s = state_ptr + slot * s_ss + o_c[None, :] * s_sc
        # The initial-history flag enters the mask as a bound, not `mask & scalar`: Triton 3.9's interpreter
        # turns a tensor & scalar bool into int32, which tl.load rejects.
        m_h = (o_w < tl.where(init, K - 1, 0))[:, None] & (o_c < C)[None, :]
        hv = tl.load(p_s + hcol[:, None] * s_sw, mask=m_h & (~from_x)[:, None], other=0.0)
        new = xv.to(state_ptr.dtype.element_ty) + hv.to(state_ptr.dtype.element_ty)
        tl.debug_barrier()  # every read of this slot's old history happens before the writes below
        tl.store(p_s + o_w[:, None] * s_sw, new, mask=m)


@triton.jit
def _conv_update_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    state_ptr,
    idx_ptr,
    acc_ptr,
    out_ptr,
    C,
    s_xn,
    s_xq,
    s_xc,
    s_wc,
    s_wk,
    s_ss,
    s_sc,
    s_sw,
    s_on,
    s_oq,
    s_oc,
    K: tl.constexpr,
    Q: tl.constexpr,
    BQ: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ACC: tl.constexpr,
    SILU: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    n = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    o_c = pid_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    slot = tl.load(idx_ptr + n).to(tl.int64)
    off = 0
    if HAS_ACC:
        off = tl.load(acc_ptr + n) - 1
    p_x = x_ptr + n * s_xn + o_c[None, :] * s_xc
    p_s = state_ptr + slot * s_ss + o_c[None, :] * s_sc
    # outputs: out_j = sum_i w_i * seq[j + i], seq = history (K - 1 columns from `off`) ++ x_0..x_{Q-1}
    o_q = tl.arange(0, BQ)
    m_q = (o_q < Q)[:, None] & m_c[None, :]
    # history reads only for a real slot: the condition enters as a bound, not `mask & scalar` (Triton 3.9's
    # interpreter turns a tensor & scalar bool into int32, which tl.load rejects)
    m_qs = (o_q < Q)[:, None] & (o_c < tl.where(slot >= 0, C, 0))[None, :]
    acc = tl.zeros([BQ, BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(K):
        p = o_q + i
        from_x = p >= K - 1
        xv = tl.load(p_x + (p - (K - 1))[:, None] * s_xq, mask=m_q & from_x[:, None], other=0.0)
        hv = tl.load(p_s + (off + p)[:, None] * s_sw, mask=m_qs & (~from_x)[:, None], other=0.0)
        wi = tl.load(w_ptr + o_c * s_wc + i * s_wk, mask=m_c, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + hv.to(tl.float32)) * wi[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + n * s_on + o_q[:, None] * s_oq + o_c[None, :] * s_oc,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_q,
    )
    # new history: seq[1:] left-aligned into columns [0, K - 2 + Q)
    o_r = tl.arange(0, BR)
    m_r = (o_r < K - 2 + Q)[:, None] & m_c[None, :]
    m_rs = (o_r < K - 2 + Q)[:, None] & (o_c < tl.where(slot >= 0, C, 0))[None, :]  # only a real slot
    p = o_r + 1
    from_x = p >= K - 1
    xv = tl.load(p_x + (p - (K - 1))[:, None] * s_xq, mask=m_r & from_x[:, None], other=0.0)
    hv = tl.load(p_s + (off + p)[:, None] * s_sw, mask=m_rs & (~from_x)[:, None], other=0.0)
    new = xv.to(state_ptr.dtype.element_ty) + hv.to(state_ptr.dtype.element_ty)
    tl.debug_barrier()  # all reads of the old history before any write
    tl.store(p_s + o_r[:, None] * s_sw, new, mask=m_rs)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """See :func:`atom_kernels.ops.conv1d.reference.causal_conv1d_varlen` (same contract)."""
    check_causal_conv1d_varlen(
        x, weight, bias, cu_seqlens, conv_state, state_indices, has_initial_state, activation
    )
    T, C = x.shape
    K = weight.shape[1]
    N = state_indices.shape[0]
    if x.device.type == "cpu":  # reads values: only under the interpreter (no device sync on a GPU)
        check_slot_values("causal_conv1d_varlen", "state_indices", state_indices, conv_state.shape[0])
        check_cu_seqlens_values("causal_conv1d_varlen", cu_seqlens, T)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous whatever x's row stride
    if N == 0:
        return out
    init = has_initial_state.to(torch.int8)
    if T > 0:
        BT, BC = 64, 128
        _conv_varlen_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
            x,
            weight,
            bias if bias is not None else x,
            cu_seqlens,
            conv_state,
            state_indices,
            init,
            out,
            T,
            N,
            C,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            conv_state.stride(0),
            conv_state.stride(1),
            conv_state.stride(2),
            out.stride(0),
            out.stride(1),
            K=K,
            BT=BT,
            BC=BC,
            BN=64,
            HAS_BIAS=bias is not None,
            SILU=activation is not None,
            num_warps=4,
        )
    BCS = 256
    _conv_varlen_state_kernel[(N, triton.cdiv(C, BCS))](
        x,
        cu_seqlens,
        conv_state,
        state_indices,
        init,
        C,
        x.stride(0),
        x.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        K=K,
        BW=triton.next_power_of_2(max(K - 1, 1)),
        BC=BCS,
        num_warps=4,
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    variant: str | None = None,
) -> torch.Tensor:
    """See :func:`atom_kernels.ops.conv1d.reference.causal_conv1d_update` (same contract).

    ``variant``: ``"tile"`` (``triton_tiles``: a channel-major or channel-contiguous state) or
    ``"columns"`` (``_conv_update_kernel``, any strides); ``None`` picks ``"tile"`` for a channel-major
    state from ``CONV_TILE_MIN_TOKENS`` tokens (``N * Q``), else ``"columns"`` (on a channel-contiguous
    state the column loads are coalesced already, and the tile kernel is not timed yet). Both give the
    same outputs and state; benchmarks time them side by side."""
    check_causal_conv1d_update(x, weight, bias, conv_state, state_indices, num_accepted, activation)
    N, Q, C = x.shape
    K = weight.shape[1]
    if x.device.type == "cpu":  # reads values: only under the interpreter (no device sync on a GPU)
        limit = conv_state.shape[2] - K + 2
        check_slot_values("causal_conv1d_update", "state_indices", state_indices, conv_state.shape[0])
        check_num_accepted_values("causal_conv1d_update", num_accepted, limit, f"W - K + 2 = {limit}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous whatever x's row stride
    layout = state_layout(conv_state)
    if variant is None:
        variant = "tile" if layout == "channel-major" and N * Q >= CONV_TILE_MIN_TOKENS else "columns"
    if variant not in ("tile", "columns"):
        raise ValueError(
            f"causal_conv1d_update (triton): variant must be 'tile', 'columns' or None, got {variant!r}"
        )
    if variant == "tile" and layout is None:
        raise ValueError(
            "causal_conv1d_update (triton): variant 'tile' needs a channel-major (strides (*, W, 1)) or "
            f"channel-contiguous (channel stride 1) conv_state, got strides {tuple(conv_state.stride())}"
        )
    if N == 0 or Q == 0:
        return out
    if variant == "tile":
        update_tiles(x, weight, bias, conv_state, state_indices, num_accepted, activation, out, layout)
        return out
    BC = 256
    _conv_update_kernel[(N, triton.cdiv(C, BC))](
        x,
        weight,
        bias if bias is not None else x,
        conv_state,
        state_indices,
        num_accepted if num_accepted is not None else state_indices,
        out,
        C,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        weight.stride(0),
        weight.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        K=K,
        Q=Q,
        BQ=triton.next_power_of_2(Q),
        BR=triton.next_power_of_2(K - 2 + Q),
        BC=BC,
        HAS_BIAS=bias is not None,
        HAS_ACC=num_accepted is not None,
        SILU=activation is not None,
        num_warps=4,
        **launch_options(x.device),
    )
    return out
