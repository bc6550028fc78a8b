"""Experiment (H200): where the fused router's time goes (full / GEMV + ticket / GEMV only), num_warps."""
import json, os, sys
import torch, triton
import triton.language as tl
sys.path.insert(0, "benchmarks/gpu")
import common
from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.moe import triton as moe_triton
from atom_kernels.ops.moe.triton_gate_router import moe_gate_router

@triton.jit
def _probe_kernel(
    x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, count_ptr, T, H, cols, num_experts, stride_x, stride_w,
    TOP_K: tl.constexpr, RENORM: tl.constexpr, NUM_SHARED: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr,
    PDL: tl.constexpr = False, MODE: tl.constexpr = 0,
):  # fmt: skip
    """Logits of router rows ``[pid * BLOCK_E, +BLOCK_E)`` for tokens ``0 .. T - 1`` (``T <= ROWS``), then,
    in the last program to arrive, the routing of every token (module docstring)."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    pid = tl.program_id(0)
    offs_t = tl.arange(0, ROWS)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    t_ok = offs_t < T
    e_ok = offs_e < cols
    w_ptrs = w_ptr + offs_e[:, None].to(tl.int64) * stride_w + offs_h[None, :]
    acc = tl.zeros([ROWS, BLOCK_E], tl.float32)
    for h0 in range(0, H, BLOCK_H):  # one iteration when BLOCK_H covers H (the decode launch)
        h_ok = (h0 + offs_h) < H
        wv = tl.load(w_ptrs + h0, mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        for r in tl.static_range(ROWS):  # the weight tile stays in registers for every token
            x_ok = h_ok & (offs_h * 0 + r < T)
            xr = tl.load(x_ptr + r * stride_x + h0 + offs_h, mask=x_ok, other=0.0).to(tl.float32)
            acc += tl.where(offs_t[:, None] == r, tl.sum(wv * xr[None, :], 1)[None, :], 0.0)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the Linear's output
    lg_ptrs = logits_ptr + offs_t[:, None] * cols + offs_e[None, :]
    tl.store(lg_ptrs, logits, mask=t_ok[:, None] & e_ok[None, :])
    if MODE == 2:
        return
    tl.debug_barrier()  # every thread's logits are written before the ticket is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if MODE == 1:
        if ticket == tl.num_programs(0) - 1:
            tl.atomic_xchg(count_ptr, 0)
        return
    if ticket == tl.num_programs(0) - 1:
        offs = tl.arange(0, E_P2)
        routed = offs < num_experts
        lg = tl.load(
            logits_ptr + offs_t[:, None] * cols + offs[None, :],
            mask=t_ok[:, None] & routed[None, :],
            other=float("-inf"),
        )
        lg = tl.where(t_ok[:, None], lg, tl.where(routed, 0.0, float("-inf"))[None, :])  # finite pad rows
        m = tl.max(lg, 1)
        p = tl.exp(lg - m[:, None])
        p = p / tl.sum(p, 1)[:, None]
        # One max per round: key = (bits of p) << 32 | expert, monotonic in p for p >= 0, ties to the
        # higher index; NaN ranks below every number (key = expert - 2^32, still the higher index
        # first) and taken experts and padding lanes below all (the rules of moe_router's kernel: the ids
        # stay distinct in [0, E), a NaN row keeps NaN weights).
        lane = offs[None, :].to(tl.int64)
        bits = p.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(p == p, (bits << 32) | lane, lane - (1 << 32))
        taken = -(1 << 62)
        key = tl.where(routed[None, :], key, taken)
        slots = tl.arange(0, K_P2)
        top_w = tl.zeros([ROWS, K_P2], tl.float32)
        top_i = tl.zeros([ROWS, K_P2], tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, 1)
            i = best & 0xFFFFFFFF
            w = tl.where(best >= 0, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), float("nan"))
            top_w = tl.where(slots[None, :] == j, w[:, None], top_w)
            top_i = tl.where(slots[None, :] == j, i[:, None], top_i)
            key = tl.where(lane == i[:, None], taken, key)
        if RENORM:
            top_w = top_w / tl.sum(tl.where(slots[None, :] < TOP_K, top_w, 0.0), 1)[:, None]
        row = TOP_K + NUM_SHARED  # output columns per token: routed, then shared
        out = offs_t[:, None] * row + slots[None, :]
        keep = t_ok[:, None] & (slots < TOP_K)[None, :]
        tl.store(weights_ptr + out, top_w, mask=keep)
        tl.store(ids_ptr + out, top_i, mask=keep)
        if NUM_SHARED > 0:  # the shared gate logit sits after the routed ones
            gate = tl.sigmoid(tl.load(logits_ptr + offs_t * cols + num_experts, mask=t_ok, other=0.0))
            for j in tl.static_range(NUM_SHARED):
                tl.store(weights_ptr + offs_t * row + TOP_K + j, gate, mask=t_ok)
                tl.store(
                    ids_ptr + offs_t * row + TOP_K + j, (offs_t * 0 + num_experts + j).to(tl.int64), mask=t_ok
                )
        tl.atomic_xchg(count_ptr, 0)  # reset for the next launch




dev = torch.device("cuda")
H, E = 2048, 512
ws = [torch.randn(E + 1, H, device=dev, dtype=torch.bfloat16) * H**-0.5 for _ in range(8)]
tickets = torch.zeros(1, dtype=torch.int32, device=dev)
rows = []
for T in (1, 2):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    wout = torch.empty((T, 11), device=dev); iout = torch.empty((T, 11), dtype=torch.int64, device=dev)
    lg = torch.empty((T, E + 1), device=dev)
    def launch(w, mode, warps, be):
        _probe_kernel[(triton.cdiv(E + 1, be),)](x_ptr=x, w_ptr=w, logits_ptr=lg, weights_ptr=wout, ids_ptr=iout,
            count_ptr=tickets, T=T, H=H, cols=E + 1, num_experts=E, stride_x=x.stride(0), stride_w=w.stride(0),
            TOP_K=10, RENORM=True, NUM_SHARED=1, ROWS=2, BLOCK_E=be, BLOCK_H=min(2048, 4096 // be), E_P2=512, K_P2=16,
            MODE=mode, num_warps=warps, **launch_options(x.device))
    ref_w, ref_i = moe_gate_router(x, ws[0], E, 10, True, 1)
    launch(ws[0], 0, 4, 2); torch.cuda.synchronize()
    assert torch.equal(iout, ref_i), "probe kernel differs from the product kernel"
    for mode in (0, 1, 2):
        for warps in (1, 2, 4, 8):
            for be in (1, 2, 4):
                us = common.time_ms(lambda: [launch(w, mode, warps, be) for w in ws], graph=True, rep_ms=40) * 1e3 / 8
                rows.append(dict(T=T, mode=["full", "gemv+ticket", "gemv"][mode], warps=warps, block_e=be, us=us))
                print(json.dumps(rows[-1]), flush=True)
    lgs = torch.randn(T, E + 1, device=dev)
    us = common.time_ms(lambda: [moe_triton.moe_router(lgs, 10, True, 1) for _ in range(8)], graph=True, rep_ms=40) * 1e3 / 8
    rows.append(dict(T=T, mode="moe_router alone (top-k kernel, 1 program per token)", us=us)); print(json.dumps(rows[-1]))
json.dump(rows, open(os.environ.get("OUT", "/tmp") + "/router_probe.json", "w"), indent=1)
