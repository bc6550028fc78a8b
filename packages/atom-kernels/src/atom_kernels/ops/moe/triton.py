"""Triton fused MoE experts: sort (token, expert) pairs by expert, two grouped GEMMs, weighted sum.

Three steps, four launches, no host synchronisation (CUDA-graph safe):

1. ``_moe_align_kernel`` (one program, launched by :func:`moe_align`): histogram of the expert ids,
   each expert's segment padded to a multiple of ``BLOCK_M`` rows, the expert of every row block, and
   the pair indices scattered into their segments (padding rows hold the sentinel ``num_pairs``). The
   experts go in chunks of ``ALIGN_E_BLOCK`` lanes with a running row offset, and each non-empty
   segment marks its first block, a running max filling the rest: the work grows with ``E``, not with
   ``next_power_of_2(E)`` (the 512 routed experts plus the shared pseudo-expert), and linearly in the
   blocks (H200, 513 experts: 6.1 us at 2 tokens, 9.3 us at 64; 512 experts: 4.9 us at 2 tokens).
   Row order inside a segment depends on atomics, but every row is computed independently and summed
   in a fixed order, so results are deterministic.
2. ``_moe_gemm1_kernel``: for one row block (one expert) and one column tile of the intermediate size,
   ``x[token] @ w13[e, gate rows].T`` and ``@ w13[e, up rows].T`` in two float32 accumulators, then
   ``silu(gate) * up`` in the epilogue (SiLU-and-mul fused: the ``[rows, 2I]`` activation never reaches
   memory). Row blocks vary fastest in the grid, so blocks of one expert run together and share its
   weight tiles through L2.
3. ``_moe_gemm2_kernel``: ``act @ w2[e].T`` written per pair (float32); then ``_moe_sum_kernel`` adds
   each token's ``K`` pair rows times their routing weights in float32, in order.

Like the reference, only the activation (x.dtype, the second GEMM's input) and the result are rounded; the
GEMM outputs stay float32.
Weights stay in the checkpoint layout (``w13 [E, 2I, H]``, ``w2 [E, H, I]``, reduction dim contiguous);
``BLOCK_K`` divides 128 and ``BLOCK_N`` divides 128, so FP8 block-scaled weights (128 x 128 scale
blocks) can later load one scale per tile without changing the layout.

The Qwen3-Next shared expert rides along as pseudo-experts ``E .. E + m - 1`` (its intermediate size
split into ``m`` slices of the routed experts'): the model stacks its weights after the routed ones at
load time and ``moe_router(..., num_shared=m)`` appends the columns ``(E + j, sigmoid(gate))`` to
``(ids, weights)``; see ``benchmarks/gpu/bench_moe.py`` ("routed+shared").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.moe.checks import check_moe_experts, check_moe_router

# Expert lanes per chunk of the align kernel: 256 was the fastest of 128/256/512 on the H200 for 512-514
# experts at 1-4096 tokens (513 experts, 2 tokens: 6.6 / 6.1 / 7.2 us).
ALIGN_E_BLOCK = 256

# Token count from which moe_router runs one warp per token (``_moe_router_warp_kernel``) instead of four
# (``_moe_router_kernel``). The four-warp program pays two block-wide reductions (shared memory and a
# barrier each) per top-k round, 2 + 2 K in all (22 at top-10); one warp per token does 2 + K warp-shuffle
# reductions and no barrier. Measured (bench_router_conv.py, router_conv_h100.json, H100, 512 + 1 columns,
# top-10, CUDA graphs): warp / block 3.78 / 4.00 us at T = 1, 3.84 / 4.05 at 16, 3.87 / 4.03 at 128,
# 4.05 / 4.80 at 512, 5.41 / 8.60 at 1024: the one-warp program is never slower, so it runs at every T.
ROUTER_WARP_MIN_T = 1


@triton.jit
def _store_routing(
    logits_ptr, w_ptr, ids_ptr, t, stride_l, num_experts, top_w, top_i, slots, TOP_K: tl.constexpr,
    RENORM: tl.constexpr, NUM_SHARED: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s routing row from its top-k (``top_w`` probabilities, ``top_i`` ids, ``K_P2`` lanes
    ``slots``): renormalised (``RENORM``), rounded to the logits' dtype, then the shared columns
    (``sigmoid`` of the logit after the routed ones, ids ``num_experts + j``)."""
    if RENORM:
        top_w = top_w / tl.sum(tl.where(slots < TOP_K, top_w, 0.0), 0)
    top_w = top_w.to(logits_ptr.dtype.element_ty).to(tl.float32)  # rounded to the logits' dtype
    row = TOP_K + NUM_SHARED  # output columns per token: routed, then shared
    tl.store(w_ptr + t * row + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + t * row + slots, top_i, mask=slots < TOP_K)
    if NUM_SHARED > 0:  # the shared gate logit sits after the routed ones: sigmoid, one weight per slice
        gate = tl.sigmoid(tl.load(logits_ptr + t * stride_l + num_experts).to(tl.float32))
        for j in tl.static_range(NUM_SHARED):
            tl.store(w_ptr + t * row + TOP_K + j, gate)
            tl.store(ids_ptr + t * row + TOP_K + j, (num_experts + j).to(tl.int64))


@triton.jit
def _moe_router_kernel(
    logits_ptr, w_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr,
    E_P2: tl.constexpr, K_P2: tl.constexpr, NUM_SHARED: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_P2)
    x = tl.load(logits_ptr + t * stride_l + offs, mask=offs < num_experts, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    p = tl.exp(x - m)
    p = p / tl.sum(p, 0)
    slots = tl.arange(0, K_P2)
    top_w = tl.zeros([K_P2], tl.float32)
    top_i = tl.zeros([K_P2], tl.int64)
    # A NaN or +inf logit makes the whole row NaN: NaN ranks as -inf, and only real experts not yet
    # taken are eligible, so the ids always lie in [0, E), distinct (they index the align kernel's
    # histogram); the weights keep the NaN.
    free = offs < num_experts
    key = tl.where(p == p, p, float("-inf"))
    for j in tl.static_range(TOP_K):  # K rounds of argmax: descending order; on exact ties (bf16 logits)
        v = tl.max(tl.where(free, key, float("-inf")), 0)  # the highest index first, as torch.topk on CPU
        i = tl.max(tl.where(free & (key == v), offs, -1), 0)
        w = tl.where(v == float("-inf"), float("nan"), v)  # v is -inf only where p[i] is NaN
        top_w = tl.where(slots == j, w, top_w)
        top_i = tl.where(slots == j, i.to(tl.int64), top_i)
        free = free & (offs != i)
    _store_routing(logits_ptr, w_ptr, ids_ptr, t, stride_l, num_experts, top_w, top_i, slots, TOP_K, RENORM,
                   NUM_SHARED)  # fmt: skip


@triton.jit
def _moe_router_warp_kernel(
    logits_ptr, w_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr,
    E_P2: tl.constexpr, K_P2: tl.constexpr, NUM_SHARED: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """``_moe_router_kernel``'s results from one warp per token (launched with ``num_warps=1``): every
    reduction stays inside the warp (register shuffles, no shared memory, no barrier), and each of the
    ``TOP_K`` rounds is one max over a packed int64 key ``(bits of p) << 32 | index`` instead of a max of
    the values and then a max of the indices holding it."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_P2)
    routed = offs < num_experts
    x = tl.load(logits_ptr + t * stride_l + offs, mask=routed, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    p = tl.exp(x - m)
    p = p / tl.sum(p, 0)
    # Rank key: the bits of p (monotonic for p >= 0), -1 for NaN (below every number: a NaN or +inf
    # logit makes the whole row NaN, and the ids stay distinct real experts), INT32_MIN for padding lanes
    # and taken experts; the low half is the index, so equal keys rank the higher index first (as
    # torch.topk on CPU and _moe_router_kernel).
    key = tl.where(p == p, p.to(tl.int32, bitcast=True), -1)
    key = tl.where(routed, key, -(2**31))
    packed = (key.to(tl.int64) << 32) | offs.to(tl.int64)
    taken = tl.full([E_P2], -(2**31), tl.int64) << 32
    slots = tl.arange(0, K_P2)
    best = tl.zeros([K_P2], tl.int64)
    for j in tl.static_range(TOP_K):  # descending order: one warp max per round
        v = tl.max(packed, 0)
        best = tl.where(slots == j, v, best)
        packed = tl.where(packed == v, taken, packed)  # packed keys are distinct: exactly one lane
    top_i = best & 0xFFFFFFFF
    top_key = (best >> 32).to(tl.int32)
    top_w = tl.where(top_key >= 0, top_key.to(tl.float32, bitcast=True), float("nan"))
    _store_routing(logits_ptr, w_ptr, ids_ptr, t, stride_l, num_experts, top_w, top_i, slots, TOP_K, RENORM,
                   NUM_SHARED)  # fmt: skip


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    cursor_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    E_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BCHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    # Work O(cdiv(E, E_BLOCK) * E_BLOCK + max_blocks + pairs): experts in chunks of E_BLOCK lanes (not
    # next_power_of_2(E) lanes), block owners by a running max (no [blocks, E] comparison).
    for b0 in range(0, max_blocks, BCHUNK):
        b = b0 + tl.arange(0, BCHUNK)
        tl.store(block_expert_ptr + b, tl.full([BCHUNK], -1, tl.int32), mask=b < max_blocks)
    tl.debug_barrier()  # the -1s land before the segments' first blocks are marked
    lanes = tl.arange(0, E_BLOCK)
    total = 0  # rows of the segments of the chunks done so far
    for c0 in range(0, num_experts, E_BLOCK):
        offs_e = c0 + lanes
        e_ok = offs_e < num_experts
        counts = tl.zeros([E_BLOCK], tl.int32)
        for start in range(0, num_pairs, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32) - c0
            counts += tl.histogram(e, E_BLOCK, mask=(e >= 0) & (e < E_BLOCK))
        padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
        starts = total + tl.cumsum(padded, 0) - padded
        tl.store(cursor_ptr + offs_e, starts, mask=e_ok)
        # each non-empty segment marks its first block with its expert (distinct blocks)
        tl.store(block_expert_ptr + starts // BLOCK_M, offs_e, mask=e_ok & (padded > 0))
        total += tl.sum(padded, 0)
    tl.debug_barrier()  # the marks are read back by other threads
    # A block's expert is the last mark at or before it (segments are in expert order): a running max.
    carry = -1
    for b0 in range(0, max_blocks, BCHUNK):
        b = b0 + tl.arange(0, BCHUNK)
        m = b < max_blocks
        mark = tl.load(block_expert_ptr + b, mask=m, other=-1)
        owner = tl.maximum(tl.associative_scan(mark, 0, _max_combine), carry)
        carry = tl.max(owner, 0)
        tl.store(block_expert_ptr + b, tl.where(b * BLOCK_M < total, owner, -1), mask=m)
    for s0 in range(0, max_blocks * BLOCK_M, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=offs < max_blocks * BLOCK_M)
    tl.debug_barrier()  # the sentinel is written before the scatter
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        m = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
        m = m & (e >= 0)  # id -1: an expert this rank does not hold (expert parallel): no row
        pos = tl.atomic_add(cursor_ptr + e, tl.full([CHUNK], 1, tl.int32), mask=m)
        tl.store(sorted_ptr + pos, offs, mask=m)


@triton.jit
def aligned_tile(
    sorted_ptr, num_pairs, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The tile of one program of an aligned-path expert GEMM (grid: ``BLOCK_M``-row blocks of
    :func:`moe_align`'s sorted pairs x ``BLOCK_N`` output columns): its rows of the sorted pairs, their
    (token, expert) pair ids and validity (padding rows hold ``num_pairs``), the output columns ``offs_n`` and
    their mask (``< N``), and the first K tile's offsets."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    return rows, pair, valid, offs_n, n_ok, offs_k


@triton.jit
def _moe_gemm1_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    H,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_at,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    rows, pair, valid, offs_n, n_ok, offs_k = aligned_tile(
        sorted_ptr, num_pairs, inter, BLOCK_M, BLOCK_N, BLOCK_K
    )
    tok = (pair // TOP_K).to(tl.int64)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + offs_k) < H
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dt = act_ptr.dtype.element_ty
    g, u = acc_g, acc_u  # float32, not rounded: only the activation is (the reference's rounding points)
    h = g * tl.sigmoid(g) * u
    out = act_ptr + rows[:, None].to(tl.int64) * stride_at + offs_n[None, :]
    tl.store(out, h.to(dt), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_gemm2_kernel(
    act_ptr,
    w_ptr,
    y_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    H,
    inter,
    stride_at,
    stride_we,
    stride_wn,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    rows, pair, valid, offs_n, n_ok, offs_k = aligned_tile(
        sorted_ptr, num_pairs, H, BLOCK_M, BLOCK_N, BLOCK_K
    )
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at + offs_k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (k0 + offs_k) < inter
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = y_ptr + pair[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(
    y_ptr,
    topw_ptr,
    ids_ptr,
    out_ptr,
    H,
    stride_yt,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(
        TOP_K
    ):  # a pair with id -1 (expert not held here) adds nothing: its row is unset
        e = tl.load(ids_ptr + t * TOP_K + j)
        rw = tl.where(e >= 0, tl.load(topw_ptr + t * TOP_K + j).to(tl.float32), 0.0)
        y = tl.load(y_ptr + (t * TOP_K + j) * stride_yt + cols, mask=m & ((cols * 0 + e) >= 0), other=0.0)
        acc += rw * y.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def moe_router(
    logits: torch.Tensor, top_k: int, renormalize: bool, num_shared: int = 0, *, variant: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) over the routed experts, top-k, optional renormalisation, and ``num_shared``
    shared columns (``sigmoid(logits[:, E])``, ids ``E + j``): one launch, one program per token.

    ``variant``: ``"warp"`` (``_moe_router_warp_kernel``, one warp per token) or ``"block"``
    (``_moe_router_kernel``, four warps per token); ``None`` picks ``"warp"`` from
    ``ROUTER_WARP_MIN_T`` tokens. Both give the same ids and weights; benchmarks time them side by side."""
    num_experts = check_moe_router(logits, top_k, renormalize, num_shared)
    num_tokens = logits.shape[0]
    if variant is None:
        variant = "warp" if num_tokens >= ROUTER_WARP_MIN_T else "block"
    if variant not in ("warp", "block"):
        raise ValueError(f"moe_router (triton): variant must be 'warp', 'block' or None, got {variant!r}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cols = top_k + num_shared
    weights = torch.empty((num_tokens, cols), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, cols), dtype=torch.int64, device=logits.device)
    if num_tokens:
        kernel = _moe_router_warp_kernel if variant == "warp" else _moe_router_kernel
        kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k, RENORM=bool(renormalize),
            E_P2=triton.next_power_of_2(num_experts), K_P2=triton.next_power_of_2(top_k),
            NUM_SHARED=num_shared, num_warps=1 if variant == "warp" else 4, **launch_options(logits.device),
        )  # fmt: skip
    return weights, ids


def check_ids_on_cpu(op: str, ids: torch.Tensor, num_experts: int) -> None:
    """Expert ids must lie in ``[-1, E)`` (-1: an expert this rank does not hold); checked only on CPU
    (Triton's interpreter), where reading the values costs no device synchronisation."""
    if ids.device.type != "cpu":
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"{op}: ids must lie in [-1, E={num_experts}), got values in [{lo}, {hi}]")


def plan(num_tokens: int, top_k: int, num_experts: int, config: dict | None = None) -> dict:
    """Tile sizes from shapes alone. Few rows per expert (decode): 16-row blocks and narrow column
    tiles for enough programs to stream the weights; many rows (prefill): 128-row blocks."""
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if rows_per_expert < 24:
        cfg = dict(BLOCK_M=16, N1=32, K1=128, W1=4, S1=4, N2=64, K2=128, W2=4, S2=4)
    else:  # 128-row blocks, 8 warps, 3 stages: 1.45 ms vs 1.63 ms for 64/4/4 at 4096 tokens (H200 sweep)
        cfg = dict(BLOCK_M=128, N1=64, K1=64, W1=8, S1=3, N2=128, K2=64, W2=8, S2=3)
    if config:
        cfg.update(config)
    return cfg


def weighted_sum(
    y: torch.Tensor, flat_w: torch.Tensor, flat_ids: torch.Tensor, out: torch.Tensor, top_k: int
) -> torch.Tensor:
    """``out[t] = sum_j flat_w[t * K + j] * y[t * K + j]`` over the pairs whose id ``flat_ids[t * K + j]``
    is not -1 (float32 sum in pair order, x.dtype out; the rows of -1 pairs are never read): one launch of
    ``_moe_sum_kernel``; ``y [T * K, H]`` per-pair expert outputs, ``out [T, H]``."""
    num_tokens, hidden = out.shape
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, flat_w, flat_ids, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=4,
        **launch_options(out.device),
    )  # fmt: skip
    return out


def moe_align(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the ``P`` (token, expert) pairs of ``flat_ids [P]`` (ids in ``[-1, E)``; a -1 pair gets no row)
    into ``block_m``-row blocks of one expert: one launch of ``_moe_align_kernel``.

    Returns ``sorted_ids [max_blocks * block_m]`` int32 (pair indices; padding rows hold ``P``) and
    ``block_expert [max_blocks]`` int32 (-1 past the last segment), ``max_blocks = P // block_m +
    min(P, E) + 1`` (each non-empty expert pads at most one block)."""
    num_pairs = flat_ids.numel()
    dev = flat_ids.device
    max_blocks = num_pairs // block_m + min(num_pairs, num_experts) + 1
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](
        flat_ids, sorted_ids, block_expert, cursor, num_pairs, num_experts, max_blocks,
        E_BLOCK=min(ALIGN_E_BLOCK, triton.next_power_of_2(num_experts)), BLOCK_M=block_m, CHUNK=1024,
        BCHUNK=256, num_warps=8, **launch_options(flat_ids.device),
    )  # fmt: skip
    return sorted_ids, block_expert


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * (silu_and_mul(x[t] @ w13[e].T) @ w2[e].T)``, ``e = ids[t, j]``.

    Ids must lie in ``[-1, E)`` (checked only on CPU: on a GPU the check would synchronise); a -1 slot (an
    expert this rank does not hold) contributes zero. ``config`` overrides the tile plan (keys of
    :func:`plan`); benchmarks use it.
    """
    check_moe_experts(x, weights, ids, w13, w2)
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("moe_experts (triton): w13 and w2 need a unit last-dim stride")
    check_ids_on_cpu("moe_experts", ids, num_experts)
    cfg = plan(num_tokens, top_k, num_experts, config)
    bm = cfg["BLOCK_M"]
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 inputs: exact products, no TF32
    dev = x.device
    flat_ids = ids.reshape(-1)
    flat_w = weights.reshape(-1)
    if not flat_ids.is_contiguous():
        flat_ids = flat_ids.contiguous()
    if not flat_w.is_contiguous():
        flat_w = flat_w.contiguous()
    sorted_ids, block_expert = moe_align(flat_ids, num_experts, bm)
    max_blocks = block_expert.numel()
    act = torch.empty((max_blocks * bm, inter), dtype=x.dtype, device=dev)
    _moe_gemm1_kernel[(max_blocks, triton.cdiv(inter, cfg["N1"]))](
        x, w13, act, sorted_ids, block_expert, num_pairs, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=cfg["N1"], BLOCK_K=cfg["K1"], PREC=prec,
        num_warps=cfg["W1"], num_stages=cfg["S1"], **launch_options(dev),
    )  # fmt: skip
    y = torch.empty((num_pairs, hidden), dtype=torch.float32, device=dev)  # summed unrounded
    _moe_gemm2_kernel[(max_blocks, triton.cdiv(hidden, cfg["N2"]))](
        act, w2, y, sorted_ids, block_expert, num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg["N2"], BLOCK_K=cfg["K2"], PREC=prec,
        num_warps=cfg["W2"], num_stages=cfg["S2"], **launch_options(dev),
    )  # fmt: skip
    return weighted_sum(y, flat_w, flat_ids, out, top_k)
