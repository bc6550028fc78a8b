"""The conv1d and gating cases of ``bench_gdn.py``: functions of a :class:`gdn_harness.Run`.

Both conv ops go through :func:`conv_case`: the triton result (output and the written window state) is
checked against the float32 reference on upcast inputs, then triton and (unless ``--quick``) the bf16
reference are timed on the original inputs.
"""

from __future__ import annotations

import torch
from gdn_harness import BF16, FP32, MAX_K, Run, get_impl


def conv_case(run: Run, bench: str, op: str, case: str, call, state, nbytes: int, *, graph: bool, **extra):
    """``call(fn, state, upcast)`` -> a no-argument callable running ``fn`` on the case's inputs (upcast to
    float32 when ``upcast``) with ``state`` as the conv state. ``graph``: time triton by CUDA-graph replay."""
    dev = run.device
    tri = get_impl(op, "triton", dev, BF16)
    ref = get_impl(op, "reference", dev, BF16)
    ref32 = get_impl(op, "reference", dev, FP32)
    if tri is None or ref32 is None:
        return
    st_t, st_r = state.clone(), state.float()
    o_t = call(tri, st_t, False)()
    o_r = call(ref32, st_r, True)()
    run.check("conv_out", BF16, case, o_t, o_r)
    run.check("conv_state", BF16, case, st_t.float(), st_r)
    run.add(bench, case, "triton", call(tri, state, False), nbytes, graph=graph, **extra)
    if ref is not None and not run.quick:
        run.add(bench, case, "reference", call(ref, state, False), nbytes, graph=False, **extra)


def conv_update(run: Run, B: int, Q: int) -> None:
    dev = run.device
    sh = run.shape
    KW, CONV_DIM = sh.kw, sh.conv_dim
    gen = torch.Generator(device=dev).manual_seed(31 * B + Q)
    W = KW - 1 + MAX_K
    x = torch.randn(B, Q, CONV_DIM, generator=gen, device=dev).to(BF16)
    w = (torch.randn(CONV_DIM, KW, generator=gen, device=dev) * 0.5).to(BF16)
    bias = None
    S = B + 3
    state = torch.randn(S, W, CONV_DIM, generator=gen, device=dev).to(BF16).transpose(1, 2)  # vLLM layout
    idx = torch.randperm(S, generator=gen, device=dev)[:B].to(torch.int32)
    na = torch.randint(1, MAX_K + 1, (B,), generator=gen, device=dev, dtype=torch.int32)

    def call(fn, st, upcast):
        xs, ws = (x.float(), w.float()) if upcast else (x, w)
        return lambda: fn(xs, ws, bias, st, idx, na, "silu")

    nbytes = B * CONV_DIM * 2 * (2 * Q + (KW - 1) + (KW - 2 + Q)) + CONV_DIM * KW * 2
    case = f"B={B} Q={Q}"
    conv_case(run, "conv_update", "causal_conv1d_update", case, call, state, nbytes, graph=True, B=B, Q=Q)


def conv_varlen(run: Run, N: int, L: int) -> None:
    dev = run.device
    sh = run.shape
    KW, CONV_DIM = sh.kw, sh.conv_dim
    gen = torch.Generator(device=dev).manual_seed(97 * N + L)
    T = N * L
    W = KW - 1 + MAX_K
    x = torch.randn(T, CONV_DIM, generator=gen, device=dev).to(BF16)
    w = (torch.randn(CONV_DIM, KW, generator=gen, device=dev) * 0.5).to(BF16)
    bias = None
    cu = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
    S = 2 * N
    state = torch.randn(S, W, CONV_DIM, generator=gen, device=dev).to(BF16).transpose(1, 2)
    idx = torch.randperm(S, generator=gen, device=dev)[:N].to(torch.int32)
    has = torch.arange(N, device=dev) % 2 == 1

    def call(fn, st, upcast):
        xs, ws = (x.float(), w.float()) if upcast else (x, w)
        return lambda: fn(xs, ws, bias, cu, st, idx, has, "silu")

    nbytes = 2 * T * CONV_DIM * 2 + 2 * N * (KW - 1) * CONV_DIM * 2
    case = f"{N}x{L}"
    conv_case(run, "conv_varlen", "causal_conv1d_varlen", case, call, state, nbytes, graph=False, N=N, L=L)


def gating(run: Run, T: int) -> None:
    dev = run.device
    sh = run.shape
    HV = sh.hv
    gen = torch.Generator(device=dev).manual_seed(T)
    A_log = torch.randn(HV, generator=gen, device=dev)
    dt = torch.randn(HV, generator=gen, device=dev)
    a = (torch.randn(T, HV, generator=gen, device=dev) * 4).to(BF16)
    b = (torch.randn(T, HV, generator=gen, device=dev) * 4).to(BF16)
    tri = get_impl("gdn_gating", "triton", dev, BF16)
    ref = get_impl("gdn_gating", "reference", dev, BF16)
    if tri is None or ref is None:
        return
    g_t, b_t = tri(A_log, a, dt, b)
    g_r, b_r = ref(A_log, a.float(), dt, b.float())
    case = f"T={T}"
    run.check("gating", FP32, case + " g", g_t, g_r)
    run.check("gating", FP32, case + " beta", b_t, b_r)
    nbytes = T * HV * (2 + 2 + 4 + 4)
    run.add("gating", case, "triton", lambda: tri(A_log, a, dt, b), nbytes, T=T)
    if not run.quick:
        run.add("gating", case, "reference", lambda: ref(A_log, a, dt, b), nbytes, graph=False, T=T)
