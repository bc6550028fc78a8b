"""Every op of one decode / verify step of Qwen3-Next-80B-A3B-FP8 (TP 1), ours beside stock vLLM 0.32's own
kernel for the same op, in the same run; and the per-step sum of each side.

What runs on the stock side: vLLM's Python package of the CPU wheel (``scripts/gpu_vllm_bundle.sh``'s bundle,
with ``scripts/gpu_vllm_run.py --check-imports`` run once before, which writes its stand-ins for vLLM's
compiled extensions), i.e. the pure-Triton kernels vLLM 0.32 runs on Hopper and the config files it ships:

| unit (per layer) | ours (atom-kernels, triton) | stock vLLM 0.32 |
|---|---|---|
| ``norm`` | ``rms_norm`` with residual | ``ir.ops.fused_add_rms_norm``'s native impl under ``torch.compile`` (vLLM's compile path; its CUDA ``vllm_c`` impl is not built here) |
| ``qkvz`` / ``attn qkv`` / ``o_proj`` FP8 GEMMs | ``fp8_linear`` | ``_per_token_group_quant_fp8`` (vLLM's Triton quant, launched as its fallback does) + ``w8a8_triton_block_scaled_mm`` |
| ``in_proj_ba``, ``lm_head``, MTP ``fc`` | ``F.linear`` (bf16, cuBLAS) | the same call: timed once, counted on both sides |
| ``router`` | ``moe_gate_router`` (gate + shared-expert gate + softmax top-10) | ``F.linear`` of the gate and of ``shared_expert_gate`` (its CUDA ``topk_softmax`` is not built here: not counted) |
| ``moe`` | ``moe_experts_fp8`` (512 experts top-10 + the shared expert as expert 513) | ``fused_moe``'s Triton GEMMs (``dispatch_fused_moe_kernel`` x 2, the config ``try_get_optimal_moe_config`` picks) + its activation quant + the shared expert's two block-FP8 GEMMs and its gate (``moe_align_block_size``, ``silu_and_mul``, ``moe_sum`` are CUDA ops not built here: not counted) |
| ``conv`` | ``causal_conv1d_update`` | ``mamba.ops.causal_conv1d.causal_conv1d_update`` (its spec-decode path for k >= 1) |
| ``gdn core`` | ``gated_delta_rule_recurrent`` / ``_verify`` with the gating fused (deferred commit) | ``fused_sigmoid_gating_delta_rule_update`` (one state written per token for k >= 1) |
| ``gated norm + out_proj`` | ``gated_norm_fp8_linear`` | ``layernorm_guard.rmsnorm_fn`` + quant + ``w8a8_triton_block_scaled_mm`` |
| ``attention`` | ``kv_cache_write`` + ``paged_attention`` (fp8 cache) | ``triton_reshape_and_cache_flash`` + ``unified_attention`` (vLLM's TRITON_ATTN backend; its default on Hopper is FlashAttention 3, a CUDA build that does not travel here) |

Stock's uncounted CUDA ops make its per-step sum a lower bound: where ours is ahead of that sum, it is ahead
of stock. Not compared (small on both sides, listed in the JSON): q/k norm + RoPE, the attention output gate,
embedding, sampling.

Shapes: hidden 2048, 512 experts top-10 (inter 512) + a 512 shared expert, GDN 16/32 heads of 128 (conv
width 4, float32 state), attention 16/2 heads of 256 (fp8 e4m3 KV cache, block 16, context ``--ctx``),
vocab 151936; random weights (e4m3 with 128x128 block scales). For each k in ``--ks`` and B in
``--batches`` the target runs M = B (1 + k) tokens; the MTP draft runs k passes of B tokens (``fc``, 3 norms,
one attention layer, MoE, ``lm_head``). Per-step sum: target = ``--layers`` (3:1 GDN:attention) x the
layer's units + final norm + ``lm_head`` over M rows; draft as above. Times are CUDA-graph replays
(``common.time_ms(graph=True)``), medians. Each pair is first run once and compared (``max_diff``: ours vs
stock, bf16 outputs); a unit that fails records its error and the rest goes on.

    python benchmarks/gpu/bench_stock_kernels.py --out $OUT            # 48 layers (an H100: --layers 32)
    python benchmarks/gpu/bench_stock_kernels.py --ks 1 --batches 1 64  # a quick look

Output ``stock_kernels_<gpu>.json`` / ``.png``.
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that made them)
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_fp8 import block_quantize  # noqa: E402

BF16, FP32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
H, E, TOP_K, INTER, VOCAB, EPS = 2048, 512, 10, 512, 151936, 1e-6
HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4
CONV_C = 2 * HK * DK + HV * DV
HQ, HKV, HD, KV_BLOCK = 16, 2, 256, 16
FP8_GEMMS = {"qkvz": (2 * HK * DK + 2 * HV * DV, H), "attn qkv": (2 * HQ * HD + 2 * HKV * HD, H),
             "o_proj": (H, HQ * HD), "out_proj": (H, HV * DV)}  # fmt: skip
# no output comparison: stateful units (their states differ by design) and units whose stock side stops
# short of the output (router: logits only; moe: without stock's uncounted CUDA ops)
NO_DIFF = ("gdn core", "conv", "attention", "router", "moe")
NOT_COMPARED = [
    "q/k norm + rope",
    "attention output gate (sigmoid * o)",
    "embedding",
    "sampling / acceptance",
]


def stock_modules() -> SimpleNamespace:
    """vLLM 0.32's kernels (needs vLLM's Python package and gpu_vllm_run's stand-ins)."""
    from vllm import ir
    from vllm.model_executor.layers.fused_moe import fused_moe as fm
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from vllm.model_executor.layers.quantization.utils import fp8_utils
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )
    from vllm.third_party.flash_linear_attention.ops.layernorm_guard import rmsnorm_fn
    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    torch._dynamo.config.cache_size_limit = 256
    native_add_norm = ir.ops.fused_add_rms_norm.impls["native"].impl_fn
    return SimpleNamespace(
        fm=fm, fp8_utils=fp8_utils, conv=causal_conv1d_update, gdn=fused_sigmoid_gating_delta_rule_update,
        rmsnorm_fn=rmsnorm_fn, reshape_and_cache=triton_reshape_and_cache_flash, attention=unified_attention,
        fp8_per_tensor=KVQuantMode.FP8_PER_TENSOR, attn_consts=triton_attn,
        add_norm=torch.compile(native_add_norm, dynamic=False),
    )  # fmt: skip


def stock_quant(st, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's Triton per-token-group(128) FP8 quant, launched as ``per_token_group_quant_fp8``'s fallback
    launches it (on CUDA vLLM calls its CUDA op instead, which is not built here)."""
    import triton

    xq = torch.empty(x.shape, device=x.device, dtype=E4M3)
    xs = torch.empty(*x.shape[:-1], x.shape[-1] // 128, device=x.device, dtype=FP32)
    fmin, fmax = st.fp8_utils.get_fp8_min_max()
    block = triton.next_power_of_2(128)
    st.fp8_utils._per_token_group_quant_fp8[(x.numel() // 128,)](
        x, xq, xs, 128, x.shape[1], x.stride(0), 1e-10, fp8_min=fmin, fp8_max=fmax, use_ue8m0=False,
        BLOCK=block, num_warps=min(max(block // 256, 1), 8), num_stages=1,
    )  # fmt: skip
    return xq, xs


def stock_fp8_linear(st, x, w, s):
    xq, xs = stock_quant(st, x)
    return st.fp8_utils.w8a8_triton_block_scaled_mm(xq, w, xs, s, [128, 128], BF16)


def align_torch(topk_ids: torch.Tensor, block: int, num_experts: int):
    """The output of vLLM's ``moe_align_block_size`` (a CUDA op, not built here) computed with torch, outside
    the timed region: token-slot ids grouped by expert, each group padded to ``block`` with ``numel``."""
    flat = topk_ids.flatten().long()
    n, dev = flat.numel(), flat.device
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block - 1) // block * block
    size = n + num_experts * (block - 1)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    order = torch.argsort(flat, stable=True)
    first = torch.cumsum(counts, 0) - counts
    start = torch.cumsum(padded, 0) - padded
    e = flat[order]
    sorted_ids[start[e] + torch.arange(n, device=dev) - first[e]] = order.to(torch.int32)
    expert_ids = torch.zeros((size + block - 1) // block, dtype=torch.int32, device=dev)
    per_block = torch.repeat_interleave(torch.arange(num_experts, device=dev), padded // block)
    expert_ids[: per_block.numel()] = per_block.to(torch.int32)
    return sorted_ids, expert_ids, padded.sum().reshape(1).to(torch.int32)


class Weights:
    """One layer's random weights of each kind (shared by every M; the step sum multiplies by layer count)."""

    def __init__(self, dev: torch.device):
        g = torch.Generator(device=dev).manual_seed(0)

        def rn(*s, scale=1.0):
            return (torch.randn(*s, generator=g, device=dev) * scale).to(BF16)

        self.fp8 = {n: block_quantize(rn(N, K, scale=K**-0.5)) for n, (N, K) in FP8_GEMMS.items()}
        self.norm_w = rn(H, scale=0.1)
        self.gate = rn(E + 1, H, scale=H**-0.5)  # the routed experts' gate, then shared_expert_gate
        q13 = torch.empty(E + 1, 2 * INTER, H, device=dev, dtype=E4M3)
        s13 = torch.empty(E + 1, 2 * INTER // 128, H // 128, device=dev)
        q2 = torch.empty(E + 1, H, INTER, device=dev, dtype=E4M3)
        s2 = torch.empty(E + 1, H // 128, INTER // 128, device=dev)
        for e in range(E + 1):
            q13[e], s13[e] = block_quantize(rn(2 * INTER, H, scale=H**-0.5))
            q2[e], s2[e] = block_quantize(rn(H, INTER, scale=INTER**-0.5))
        self.w13, self.s13, self.w2, self.s2 = q13, s13, q2, s2
        self.conv_w = rn(CONV_C, CONV_K, scale=0.5)
        self.A_log = torch.log(1.0 + 15.0 * torch.rand(HV, generator=g, device=dev)).to(BF16)
        self.dt_bias = rn(HV)
        self.gnorm_w = rn(DV, scale=0.1) + 1.0
        self.lm_head = rn(VOCAB, H, scale=H**-0.5)
        self.ba = rn(2 * HV, H, scale=H**-0.5)
        self.fc = rn(H, 2 * H, scale=(2 * H) ** -0.5)


def units(ours, st, w: Weights, B: int, Q: int, ctx: int, dev: torch.device) -> dict[str, tuple]:
    """Per unit: (ours_fn, stock_fn or None, counted_on_both) at M = B * Q tokens (B sequences of Q)."""
    from atom_kernels.ops.gated_delta_rule import pending_width

    M = B * Q
    g = torch.Generator(device=dev).manual_seed(7 * M + Q)

    def rn(*s, scale=1.0, dtype=BF16):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(dtype)

    x, res = rn(M, H), rn(M, H)
    u: dict[str, tuple] = {}
    wn = w.norm_w
    u["norm"] = (lambda: ours.rms_norm(x, wn, EPS, res), lambda: st.add_norm(x, res, wn.float() + 1.0, EPS))
    for name in ("qkvz", "attn qkv", "o_proj"):
        wq, ws = w.fp8[name]
        a = rn(M, wq.shape[1])
        u[name] = (lambda a=a, wq=wq, ws=ws: ours.fp8_linear(a, wq, ws),
                   lambda a=a, wq=wq, ws=ws: stock_fp8_linear(st, a, wq, ws))  # fmt: skip
    u["in_proj_ba (bf16)"] = (lambda: F.linear(x, w.ba), None)
    u["lm_head (bf16)"] = (lambda: F.linear(x, w.lm_head), None)
    u["mtp fc (bf16)"] = (lambda: F.linear(torch.cat([x, res], -1), w.fc), None)
    tickets = torch.zeros(1, dtype=torch.int32, device=dev)
    gate_r, gate_s = w.gate[:E], w.gate[E:]
    # ours: the model's folded router (atom_models.moe.router_rows): E + 1 rows padded to 520 with the shared
    # gate row repeated, so that the Linear's output rows (T > FUSED_MAX_T) stay 16-byte aligned
    gate_ours = torch.cat([w.gate, gate_s.expand(-(-(E + 1) // 8) * 8 - (E + 1), -1)])
    u["router"] = (lambda: ours.moe_gate_router(x, gate_ours, E, TOP_K, True, 1, tickets=tickets),
                   lambda: (F.linear(x, gate_r), F.linear(x, gate_s)))  # fmt: skip

    # MoE: the same routing on both sides (ours: the shared expert is expert E with weight sigmoid(gate))
    rw, rid = torch.softmax(torch.randn(M, E, generator=g, device=dev), -1).topk(TOP_K, -1)
    rw = rw / rw.sum(-1, keepdim=True)
    sg = torch.sigmoid(torch.randn(M, 1, generator=g, device=dev))
    ids = torch.cat([rid, torch.full((M, 1), E, device=dev, dtype=rid.dtype)], 1)
    wts = torch.cat([rw, sg], 1)
    from atom_kernels.ops.moe import experts_fp8_tickets

    mt = torch.zeros(experts_fp8_tickets(H), dtype=torch.int32, device=dev)
    w13r, s13r, w2r, s2r = w.w13[:E], w.s13[:E], w.w2[:E], w.s2[:E]
    cfg = st.fm.try_get_optimal_moe_config(
        w13r.shape, w2r.shape, TOP_K, "fp8_w8a8", M, block_shape=[128, 128]
    )
    naive = M * TOP_K * 4 <= E  # stock skips moe_align_block_size there (its low-latency path)
    rid32, rw32 = rid.to(torch.int32), rw.contiguous()
    if naive:
        sids, eids = None, rid32.view(-1)
        ntp = torch.full((1,), rid.numel() * cfg["BLOCK_SIZE_M"], dtype=torch.int32, device=dev)
    else:
        sids, eids, ntp = align_torch(rid32, cfg["BLOCK_SIZE_M"], E)
    c1 = torch.empty(M, TOP_K, 2 * INTER, device=dev, dtype=BF16)
    act = rn(M * TOP_K, INTER)  # silu_and_mul's output (that CUDA op is not run)
    c3 = torch.empty(M, TOP_K, H, device=dev, dtype=BF16)
    sh_act = rn(M, INTER)
    sh13 = (w.w13[E], w.s13[E])
    sh2 = (w.w2[E], w.s2[E])

    def gemm(a_q, a_s, wt, ws, out, mul, topk):
        st.fm.dispatch_fused_moe_kernel(
            a_q, wt, out, a_s, ws, None, rw32, sids, eids, ntp, mul, topk, cfg, compute_type=st.fm.tl.bfloat16,
            use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
            per_channel_quant=False, block_shape=[128, 128],
        )  # fmt: skip

    def stock_moe():
        aq, as_ = stock_quant(st, x)
        gemm(aq, as_, w13r, s13r, c1, False, TOP_K)
        bq, bs = stock_quant(st, act)
        gemm(bq, bs, w2r, s2r, c3, True, 1)
        stock_fp8_linear(st, x, *sh13)
        return stock_fp8_linear(st, sh_act, *sh2)

    u["moe"] = (lambda: ours.moe_experts_fp8(x, wts, ids, w.w13, w.s13, w.w2, w.s2, tickets=mt), stock_moe)

    # GDN conv: ours [S, C, W] (left-aligned, W = K - 2 + Q); stock [S, W', C] viewed as [S, C, W']
    S = B + 1
    idx = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
    acc = torch.ones(B, dtype=torch.int32, device=dev)
    xc = rn(B, Q, CONV_C)
    cs_ours = rn(S, CONV_C, CONV_K - 2 + Q)
    cs_st = rn(S, CONV_K - 1 + Q - 1, CONV_C).transpose(1, 2)
    qsl = torch.arange(0, M + 1, Q, dtype=torch.int32, device=dev)
    xs_flat = xc.reshape(M, CONV_C)
    if Q == 1:
        stock_conv = lambda: st.conv(xs_flat, cs_st, w.conv_w, None, "silu", conv_state_indices=idx,  # noqa: E731
                                     out=torch.empty_like(xs_flat))  # fmt: skip
    else:
        stock_conv = lambda: st.conv(xs_flat, cs_st, w.conv_w, None, "silu", conv_state_indices=idx,  # noqa: E731
                                     num_accepted_tokens=acc, query_start_loc=qsl, max_query_len=Q,
                                     out=torch.empty_like(xs_flat))  # fmt: skip
    u["conv"] = (lambda: ours.causal_conv1d_update(xc, w.conv_w, None, cs_ours, idx, None if Q == 1 else acc),
                 stock_conv)  # fmt: skip

    # GDN core: float32 state pool; stock writes one state per token for k >= 1 (B * Q + 1 slots)
    q, k, v = rn(B, Q, HK, DK), rn(B, Q, HK, DK), rn(B, Q, HV, DV)
    a, b = rn(M, HV, scale=2.0), rn(M, HV, scale=2.0)
    pool_o = rn(S, HV, DV, DK, scale=0.5, dtype=FP32)
    P = pending_width(HK, DK, HV, DV)
    pend = rn(S, Q, P, scale=0.3, dtype=FP32)
    pend[..., HK * DK + HV * DV :] = -torch.rand(S, Q, HV, generator=g, device=dev) * 0.5
    commit = torch.full((B,), Q, dtype=torch.int32, device=dev)
    pool_s = rn(M + 1, HV, DV, DK, scale=0.5, dtype=FP32)
    idx2d = torch.arange(1, M + 1, dtype=torch.int32, device=dev).view(B, Q)
    flat = [t.reshape(1, M, *t.shape[2:]) for t in (q, k, v)]
    kw = {"A_log": w.A_log, "dt_bias": w.dt_bias}
    a3, b3 = a.view(B, Q, HV), b.view(B, Q, HV)
    scale = DK**-0.5
    if Q == 1:
        ours_gdn = lambda: ours.gated_delta_rule_recurrent(q, k, v, a3, b3, pool_o, idx, scale, True, **kw)  # noqa: E731
    else:
        ours_gdn = lambda: ours.gated_delta_rule_verify(q, k, v, a3, b3, pool_o, pend, idx, commit, scale, True,  # noqa: E731
                                                        **kw)  # fmt: skip
    u["gdn core"] = (ours_gdn, lambda: st.gdn(
        A_log=w.A_log, a=a, b=b, dt_bias=w.dt_bias, q=flat[0], k=flat[1], v=flat[2], scale=scale,
        initial_state=pool_s, inplace_final_state=True, cu_seqlens=qsl,
        ssm_state_indices=idx if Q == 1 else idx2d, num_accepted_tokens=None if Q == 1 else acc,
        use_qk_l2norm_in_kernel=True)[0])  # fmt: skip

    o, z = rn(M, HV, DV), rn(M, HV, DV)
    wo, so = w.fp8["out_proj"]

    def stock_gated_out():
        y = st.rmsnorm_fn(o.view(-1, DV), w.gnorm_w, None, z=z.view(-1, DV), eps=EPS, norm_before_gate=True)
        return stock_fp8_linear(st, y.view(M, HV * DV), wo, so)

    u["gated norm + out_proj"] = (lambda: ours.gated_norm_fp8_linear(o, z, w.gnorm_w, EPS, wo, so),
                                  stock_gated_out)  # fmt: skip

    # attention: fp8 caches [blocks, 16, Hkv, D], shared layout; context ctx (+ the Q new tokens)
    nblk = (ctx + Q + KV_BLOCK - 1) // KV_BLOCK
    kc = rn(B * nblk + 1, KV_BLOCK, HKV, HD, scale=0.5).to(E4M3)
    vc = rn(B * nblk + 1, KV_BLOCK, HKV, HD, scale=0.5).to(E4M3)
    bt = (torch.arange(B * nblk, device=dev, dtype=torch.int32) + 1).view(B, nblk)
    seq = torch.full((B,), ctx + Q, dtype=torch.int32, device=dev)
    pos = ctx + torch.arange(Q, device=dev)
    slots = bt[:, :].gather(1, (pos // KV_BLOCK)[None].expand(B, Q).long()) * KV_BLOCK + pos % KV_BLOCK
    slots = slots.reshape(M).long()
    qa, ka, va = rn(M, HQ, HD), rn(M, HKV, HD), rn(M, HKV, HD)
    ks = torch.tensor(0.05, device=dev)
    out = torch.empty(M, HQ, HD, device=dev, dtype=BF16)
    thr = st.attn_consts.MIN_LAUNCH_GRID_SIZE_2D // HKV
    nseg = st.attn_consts.NUM_PAR_SOFTMAX_SEGMENTS
    segm = torch.empty(thr, HQ, nseg, HD, device=dev, dtype=FP32)
    segm_max = torch.empty(thr, HQ, nseg, device=dev, dtype=FP32)
    segm_sum = torch.empty(thr, HQ, nseg, device=dev, dtype=FP32)
    ks1 = ks.reshape(1)

    def ours_attn():
        ours.kv_cache_write(ka, va, kc, vc, slots, ks, ks)
        return ours.paged_attention(qa, kc, vc, bt, seq, qsl, HD**-0.5, ks, ks)

    def stock_attn():
        st.reshape_and_cache(ka, va, kc, vc, slots, "fp8", ks1, ks1)
        st.attention(q=qa, k=kc, v=vc, out=out, cu_seqlens_q=qsl, max_seqlen_q=Q, seqused_k=seq,
                     max_seqlen_k=ctx + Q, softmax_scale=HD**-0.5, causal=True, window_size=(-1, -1),
                     block_table=bt, softcap=0, q_descale=None, k_descale=ks1.expand(B, HKV),
                     v_descale=ks1.expand(B, HKV), seq_threshold_3D=thr, num_par_softmax_segments=nseg,
                     softmax_segm_output=segm, softmax_segm_max=segm_max, softmax_segm_expsum=segm_sum,
                     kv_quant_mode=st.fp8_per_tensor)  # fmt: skip
        return out

    u["attention"] = (ours_attn, stock_attn)
    return u


def step_counts(layers: int, k: int) -> dict[str, dict[str, int]]:
    """How often each unit runs in one step: ``{"target": {...}, "draft": {...}}`` (draft: per pass)."""
    gdn, attn = layers * 3 // 4, layers // 4
    target = {"norm": 2 * layers + 1, "qkvz": gdn, "in_proj_ba (bf16)": gdn, "conv": gdn, "gdn core": gdn,
              "gated norm + out_proj": gdn, "attn qkv": attn, "attention": attn, "o_proj": attn,
              "router": layers, "moe": layers, "lm_head (bf16)": 1}  # fmt: skip
    draft = {"mtp fc (bf16)": 1, "norm": 5, "attn qkv": 1, "attention": 1, "o_proj": 1, "router": 1, "moe": 1,
             "lm_head (bf16)": 1}  # fmt: skip
    return {"target": target, "draft": draft if k else {}}


def diff(a, b) -> float | None:
    a = a[0] if isinstance(a, tuple) else a
    b = b[0] if isinstance(b, tuple) else b
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.numel() != b.numel():
        return None
    return (a.float().reshape(-1) - b.float().reshape(-1)).abs().max().item()


def time_units(ours, st, w, B, Q, ctx, dev, rep_ms, only=None) -> dict[str, dict]:
    res: dict[str, dict] = {}
    try:
        us = units(ours, st, w, B, Q, ctx, dev)
    except Exception as exc:
        traceback.print_exc()
        return {"(setup)": {"error": f"{type(exc).__name__}: {exc}"[:400]}}
    for name, (fo, fs) in us.items():
        if only is not None and name not in only:
            continue
        r: dict = {"M": B * Q}
        for side, fn in (("ours", fo), ("stock", fs)):
            if fn is None:
                continue
            try:
                fn()
                torch.cuda.synchronize()
                r[f"{side}_ms"] = common.time_ms(fn, graph=True, rep_ms=rep_ms)
            except Exception as exc:
                traceback.print_exc()
                r[f"{side}_error"] = f"{type(exc).__name__}: {exc}"[:400]
        if fs is None:
            r["stock_ms"], r["same_call"] = r.get("ours_ms"), True
        elif "ours_error" not in r and "stock_error" not in r and name not in NO_DIFF:
            r["max_diff"] = diff(fo(), fs())
        res[name] = r
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rep-ms", type=int, default=40)
    args = ap.parse_args()
    out = common.out_dir(args.out)
    dev = common.require_cuda()
    ceil = common.ceilings(out, dev)
    st = stock_modules()
    ours = common.backend_ops("triton", dev, [
        "rms_norm", "fp8_linear", "moe_gate_router", "moe_experts_fp8", "causal_conv1d_update",
        "gated_delta_rule_recurrent", "gated_delta_rule_verify", "gated_norm_fp8_linear", "kv_cache_write",
        "paged_attention"])  # fmt: skip
    t0 = time.perf_counter()
    w = Weights(dev)
    rows, steps = [], []
    cache: dict[tuple[int, int], dict] = {}
    for k in args.ks:
        for B in args.batches:
            Q = 1 + k
            if (B, Q) not in cache:
                cache[(B, Q)] = time_units(ours, st, w, B, Q, args.ctx, dev, args.rep_ms)
            draft_key = (B, 1)
            if k and draft_key not in cache:
                cache[draft_key] = time_units(ours, st, w, B, 1, args.ctx, dev, args.rep_ms)
            counts = step_counts(args.layers, k)
            tot = {"ours": 0.0, "stock": 0.0}
            missing = []
            for part, key in (("target", (B, Q)), ("draft", draft_key)):
                for unit, n in counts[part].items():
                    r = cache[key].get(unit, {})
                    times = n * (k if part == "draft" else 1)
                    for side in tot:
                        if r.get(f"{side}_ms") is None:
                            missing.append(f"{part}:{unit}:{side}")
                        else:
                            tot[side] += times * r[f"{side}_ms"]
            for unit, r in cache[(B, Q)].items():
                rows.append({"k": k, "B": B, "unit": unit, **r,
                             "stock_over_ours": (r["stock_ms"] / r["ours_ms"]) if r.get("stock_ms") and r.get("ours_ms") else None})  # fmt: skip
            steps.append({"k": k, "B": B, "ours_step_ms": tot["ours"], "stock_step_ms": tot["stock"],
                          "stock_over_ours": tot["stock"] / tot["ours"] if tot["ours"] else None,
                          "missing": missing})  # fmt: skip
            print(f"k={k} B={B}: per-step sum ours {tot['ours']:.2f} ms, stock (lower bound) {tot['stock']:.2f} ms"
                  + (f"; missing {missing}" if missing else ""), flush=True)  # fmt: skip
            common.write_json(out / "stock_kernels_partial.json", {"rows": rows, "steps": steps})
    payload = {"env": common.environment(), "ceilings": ceil, "layers": args.layers, "ctx": args.ctx,
               "not_compared": NOT_COMPARED, "units": cache_rows(cache), "rows": rows, "steps": steps,
               "wall_s": time.perf_counter() - t0}  # fmt: skip
    name = f"stock_kernels_{common.gpu_tag(dev)}"
    common.write_json(out / f"{name}.json", payload)
    common.print_table(rows, ["k", "B", "unit", "M", "ours_ms", "stock_ms", "stock_over_ours", "max_diff"])
    common.print_table(steps, ["k", "B", "ours_step_ms", "stock_step_ms", "stock_over_ours"])
    plot(steps, out / f"{name}.png", args.layers, common.gpu_tag(dev))


def cache_rows(cache: dict) -> list[dict]:
    return [{"B": B, "Q": Q, "unit": u, **r} for (B, Q), us in cache.items() for u, r in us.items()]


def plot(steps: list[dict], path: Path, layers: int, gpu: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"k={s['k']}\nB={s['B']}" for s in steps]
    xs = range(len(steps))
    ax.bar([i - 0.2 for i in xs], [s["ours_step_ms"] for s in steps], 0.4, label="ours (atom-kernels)")
    ax.bar(
        [i + 0.2 for i in xs],
        [s["stock_step_ms"] for s in steps],
        0.4,
        label="stock vLLM 0.32 kernels (lower bound)",
    )
    ax.set_xticks(list(xs), labels)
    ax.set_yscale("log")
    ax.set_ylabel("per-step kernel time, ms (sum of CUDA-graph replays)")
    ax.set_title(f"Qwen3-Next-80B-A3B-FP8 step, {layers} layers + MTP, {gpu.upper()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
