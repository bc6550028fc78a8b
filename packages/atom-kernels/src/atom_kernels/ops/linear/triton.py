"""Triton ``linear``: one GEMV launch at decode-sized token counts, ``torch.nn.functional.linear`` elsewhere.

At ``M <= GEMV_MAX_M`` rows and ``N <= GEMV_MAX_N`` output features (a GDN layer's ``in_proj_ba`` at decode:
1-4 tokens, 64 features for the 80B model) the work is one read of a small weight, and cuBLAS's smallest
GEMM tile is bound by its launch and latency. ``_gemv_kernel`` instead: program ``p`` computes the output
features ``[p * BLOCK_N, +BLOCK_N)`` for every row. It walks K in ``BLOCK_K`` chunks, multiplies each
``[BLOCK_N, BLOCK_K]`` weight tile (read once, for all rows) elementwise with the ``[ROWS, BLOCK_K]`` chunk
of x into a float32 ``[ROWS, BLOCK_N, BLOCK_K]`` accumulator, and reduces over K once at the end; the bias
is added in float32 and the result rounded to x.dtype once. No tensor cores (too few rows), no split-K (no
grid-wide counters), so one launch and no scratch. :func:`plan` picks the tiles from the shapes; every
knob can be overridden per call (benchmarks sweep them).

No host synchronisation (CUDA-graph safe). Launched with the decode kernels' PDL options
(:func:`~atom_kernels.ops._pdl.launch_options`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atom_kernels.ops._device import device_sms
from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.linear.checks import check_linear

# Largest row count on the GEMV path: every program multiplies all M rows with its weight tile, so the
# accumulator (and the FMAs per weight byte) grow with M. H200, K = 2048, weights L2-cold, CUDA graphs
# (benchmarks/results/linear_h200.json): N = 64 (in_proj_ba) 1.6 / 2.2 / 1.6 us at M = 1 / 2 / 4 against
# 5.3 us for cuBLAS; N = 1024 2.9 / 2.9 / 4.2 us against 12.6 / 10.4 / 9.3 us. 4 covers a batch-1 MTP verify
# with up to three draft tokens.
GEMV_MAX_M = 4
# Widest output on the GEMV path: past ~1024 features cuBLAS's tiles fill the GPU and its launch cost is a
# small part of the GEMM.
GEMV_MAX_N = 1024
NUM_WARPS = 4
NUM_STAGES = 2
ACC_PER_THREAD = 64  # float32 accumulator elements per thread; BLOCK_K shrinks to stay within it
MIN_BLOCK_K = 32


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """``y[:M, n-tile] = x @ w[n-tile].T (+ b[n-tile])`` for ``M <= ROWS``; program ``pid`` covers the
    ``BLOCK_N`` features from ``pid * BLOCK_N``. ``y`` is contiguous ``[M, N]``."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    pid = tl.program_id(0)
    offs_r = tl.arange(0, ROWS)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # 3-d pointer tiles ([ROWS, 1, BLOCK_K] and [1, BLOCK_N, BLOCK_K]): the loads take the accumulator's
    # layout (16-byte vectors along K), so the product needs no layout conversion
    r_ok = (offs_r < M)[:, None, None]
    n_ok = (offs_n < N)[None, :, None]
    x_ptrs = x_ptr + offs_r[:, None, None].to(tl.int64) * stride_xm + offs_k[None, None, :]
    w_ptrs = w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :]
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=r_ok, other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_ok, other=0.0)
        else:
            k_ok = ((k0 + offs_k) < K)[None, None, :]
            x = tl.load(x_ptrs + k0, mask=r_ok & k_ok, other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_ok & k_ok, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)
    y = tl.sum(acc, 2)  # [ROWS, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_r[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(offs_r < M)[:, None] & (offs_n < N)[None, :])


def plan(
    m: int,
    n: int,
    k: int,
    sms: int,
    *,
    max_m: int = GEMV_MAX_M,
    max_n: int = GEMV_MAX_N,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> dict | None:
    """The GEMV launch for ``x [m, k] @ w [n, k].T`` on a device of ``sms`` multiprocessors, or None where
    ``F.linear`` runs (``m == 0``, ``n == 0``, ``k == 0``, ``m > max_m`` or ``n > max_n``).

    ``ROWS = next_pow2(m)``; ``BLOCK_N`` (default): the widest of 16, 8, 4, 2 that still gives one program per
    multiprocessor, else 1 (the 80B model's 64 ``in_proj_ba`` features: 64 programs of one weight row);
    ``BLOCK_K``: the whole (power-of-two padded) K where the ``[ROWS, BLOCK_N, BLOCK_K]`` float32
    accumulator fits ``ACC_PER_THREAD`` registers per thread, else the largest power of two that does
    (at least ``MIN_BLOCK_K``).
    """
    if m == 0 or n == 0 or k == 0 or m > max_m or n > max_n:
        return None
    rows = triton.next_power_of_2(m)
    warps = NUM_WARPS if num_warps is None else num_warps
    if block_n is None:
        block_n = next((b for b in (16, 8, 4, 2) if triton.cdiv(n, b) >= sms), 1)
    budget = ACC_PER_THREAD * 32 * warps
    block_k = min(triton.next_power_of_2(k), max(MIN_BLOCK_K, budget // (rows * block_n)))
    stages = NUM_STAGES if num_stages is None else num_stages
    return dict(ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    max_m: int = GEMV_MAX_M,
    max_n: int = GEMV_MAX_N,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """``x [..., K] @ weight [N, K].T (+ bias [N])`` -> ``[..., N]`` in x.dtype (see the reference): one
    ``_gemv_kernel`` launch where :func:`plan` gives one (at most ``max_m`` rows and ``max_n`` features, a
    weight with unit last stride), else ``F.linear``. ``block_n`` (a power of two), ``num_warps`` and
    ``num_stages`` override the plan (benchmark knobs)."""
    check_linear(x, weight, bias)
    if block_n is not None and (block_n < 1 or block_n & (block_n - 1)):
        raise ValueError(f"linear (triton): block_n must be a power of two, got {block_n}")
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    cfg = plan(m, n, k, device_sms(x.device), max_m=max_m, max_n=max_n, block_n=block_n,
               num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    if cfg is None or weight.stride(-1) != 1:
        return F.linear(x, weight, bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x_ptr=x2, w_ptr=weight, b_ptr=y if bias is None else bias, y_ptr=y, M=m, N=n, K=k,
        stride_xm=x2.stride(0), stride_wn=weight.stride(0), ROWS=cfg["ROWS"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], EVEN_K=k % cfg["BLOCK_K"] == 0, HAS_BIAS=bias is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(x.device),
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
