"""moe_experts_fp8 (W8A8 block-scaled experts) against a per-token loop in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_kernels.testing import assert_close, randn

E4M3 = torch.float8_e4m3fn
# (what, dtype) -> (atol, rtol) against the float64 per-token loop (same e4m3 rounding of the inputs).
# Measured max abs error in the comments (reference on CPU; triton on the H200: see docs/performance.md).
TOL = {
    ("moe_fp8", torch.float32): (1e-5, 1e-5),  # measured 3.4e-07 (|out| ~ 0.6)
    # bf16: GEMM outputs round to bf16 before the activation's quantisation, so a different accumulation
    # order can move one e4m3 step (2^-4 of one element's contribution): measured 1.7e-03 (|out| ~ 0.6)
    ("moe_fp8", torch.bfloat16): (3e-2, 2e-2),
}
DTYPES = [torch.float32, torch.bfloat16]


def block_quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (e4m3, ``[ceil(N/bn), ceil(K/bk)]`` scales), per block absmax / 448."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    pad = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).reshape(nb, bn, kb, bk)
    s = pad.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
    q = (pad / s[:, None, :, None]).reshape(nb * bn, kb * bk)[:n, :k]
    return q.to(E4M3), s


def make_experts(num_experts, hidden, inter, block, device, seed=0):
    bn, bk = block
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.05
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.05
    q13, s13, q2, s2 = [], [], [], []
    for e in range(num_experts):
        (gq, gs), (uq, us) = block_quantize(w13[e, :inter], bn, bk), block_quantize(w13[e, inter:], bn, bk)
        q13.append(torch.cat([gq, uq]))
        s13.append(torch.cat([gs, us]))
        dq, ds = block_quantize(w2[e], bn, bk)
        q2.append(dq)
        s2.append(ds)
    return [torch.stack(t).to(device) for t in (q13, s13, q2, s2)]


def qdq64(a: torch.Tensor, group: int) -> torch.Tensor:
    k = a.shape[-1]
    groups = -(-k // group)
    ap = F.pad(a.float(), (0, groups * group - k)).reshape(*a.shape[:-1], groups, group)
    s = ap.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (ap / s).clamp(-448, 448).to(E4M3).double() * s.double()
    return q.reshape(*a.shape[:-1], groups * group)[..., :k]


def deq64(w: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    full = s.double().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
    return w.double() * full


def per_token_loop(x, weights, ids, q13, s13, q2, s2, block):
    bn, bk = block
    x, weights, ids = x.cpu(), weights.cpu(), ids.cpu()
    q13, s13, q2, s2 = q13.cpu(), s13.cpu(), q2.cpu(), s2.cpu()
    inter = q13.shape[1] // 2
    nb = -(-inter // bn)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xq = qdq64(x[t : t + 1], bk)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = xq @ deq64(q13[e, :inter], s13[e, :nb], bn, bk).t()
            up = xq @ deq64(q13[e, inter:], s13[e, nb:], bn, bk).t()
            g, u = gate.to(x.dtype).double(), up.to(x.dtype).double()
            act = (g * torch.sigmoid(g) * u).to(x.dtype)
            y = (qdq64(act, bk) @ deq64(q2[e], s2[e], bn, bk).t()).to(x.dtype).double()
            out[t] += float(weights[t, j]) * y[0]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 64), (7, 64), (40, 192)])
def test_moe_experts_fp8_matches_per_token_loop(impl, tol, device, dtype, tokens, inter):
    fn = impl("moe_experts_fp8", dtype)
    num_experts, hidden, top_k, block = 8, 256, 2, (128, 128)
    q13, s13, q2, s2 = make_experts(num_experts, hidden, inter, block, device)
    x = randn(tokens, hidden, seed=1, dtype=dtype, device=device)
    logits = randn(tokens, num_experts, seed=2, dtype=torch.float32, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    out = fn(x, weights, ids, q13, s13, q2, s2, block)
    assert out.shape == x.shape and out.dtype == dtype
    expected = per_token_loop(x, weights, ids, q13, s13, q2, s2, block)
    assert_close(out, expected, tol("moe_fp8", dtype), f"moe_experts_fp8 {dtype} T={tokens} I={inter}")


def test_moe_experts_fp8_bad_inputs(impl, device):
    fn = impl("moe_experts_fp8", torch.float32)
    q13, s13, q2, s2 = make_experts(4, 256, 64, (128, 128), device)
    x = torch.zeros(3, 256, device=device)
    w = torch.full((3, 2), 0.5, device=device)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=device)
    with pytest.raises(
        ValueError, match=r"w13_scale must have shape \[E=4, 2\*ceil\(I/bn\)=2, ceil\(H/bk\)=2\]"
    ):
        fn(x, w, ids, q13, s13[:, :1], q2, s2, (128, 128))
    with pytest.raises(ValueError, match="w13 must have dtype float8_e4m3fn"):
        fn(x, w, ids, q13.float(), s13, q2, s2, (128, 128))
    with pytest.raises(ValueError, match="block must be a pair of positive ints"):
        fn(x, w, ids, q13, s13, q2, s2, (128,))


# --- Triton: activation quantisation inside the GEMMs (INLINE_QUANT) --------------------------------------


def _moe_fp8_triton(device: torch.device, dtype: torch.dtype):
    """The Triton FP8 MoE module where its kernels run: a GPU, or CPU under ``TRITON_INTERPRET=1`` in
    float32 (the interpreter's bf16 dots are wrong; its e4m3 conversion differs from the GPU's, so
    there only path-against-path equality is checked)."""
    pytest.importorskip("triton", reason="atom-kernels' Triton backend is optional: triton is not installed")
    from atom_kernels.ops._triton_env import interpreting

    if device.type == "cpu" and not (interpreting() and dtype == torch.float32):
        pytest.skip(
            "the Triton FP8 MoE runs on a GPU (--device cuda), or on CPU in float32 under TRITON_INTERPRET=1"
        )
    from atom_kernels.ops.moe import triton_fp8

    return triton_fp8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 128), (2, 256), (8, 128)])
def test_moe_fp8_inline_quant_equals_separate_quant(device, dtype, tokens, inter):
    """Decode shapes (16-row blocks): the GEMMs' in-register quantisation of each K tile (one scale group)
    gives the operands and scales of the separate ``_act_quant_kernel`` launches, and the dots are the
    same in the same order, so the outputs are equal; on a GPU the inline path also matches the loop."""
    mod = _moe_fp8_triton(device, dtype)
    num_experts, hidden, top_k, block = 16, 256, 4, (128, 128)
    assert mod.plan(tokens, top_k, num_experts)["INLINE_QUANT"] is True, "the decode plan quantises inline"
    q13, s13, q2, s2 = make_experts(num_experts, hidden, inter, block, device, seed=3)
    logits = randn(tokens, num_experts, seed=5, dtype=torch.float32, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    x = randn(tokens, hidden, seed=4, dtype=dtype, device=device)
    edge = x.clone()
    edge[0, :128] = 0.0  # an all-zero group (scale floor) and zeros that skip the division
    edge[-1, 130] = 300.0  # one large value: the rest of its group quantises to small values, subnormals too
    for case, inp in (("random", x), ("zero group + outlier", edge)):
        args = (inp, weights, ids, q13, s13, q2, s2, block)
        on = mod.moe_experts_fp8(*args, config={"INLINE_QUANT": True})
        off = mod.moe_experts_fp8(*args, config={"INLINE_QUANT": False})
        diff = (on.double() - off.double()).abs().max().item()
        assert torch.equal(on, off), (
            f"inline != separate quant ({case}, max |diff| {diff:.3e}) T={tokens} I={inter}"
        )
    if device.type == "cuda":
        on = mod.moe_experts_fp8(x, weights, ids, q13, s13, q2, s2, block)  # the default plan: inline
        expected = per_token_loop(x, weights, ids, q13, s13, q2, s2, block)
        tol = TOL.get(("moe_fp8", dtype, "triton"), TOL[("moe_fp8", dtype)])
        assert_close(on, expected, tol, f"moe_experts_fp8 inline quant {dtype} T={tokens} I={inter}")


def test_moe_fp8_inline_quant_plan_and_block_check():
    """The plan's default (inline at 16-row blocks, separate at 128-row blocks) and the error for an
    explicit INLINE_QUANT where one K tile cannot be one scale group (block[1] > 128). No kernel runs."""
    pytest.importorskip("triton", reason="atom-kernels' Triton backend is optional: triton is not installed")
    from atom_kernels.ops.moe import triton_fp8

    assert triton_fp8.plan(2, 10, 512)["INLINE_QUANT"] is True
    assert triton_fp8.plan(4096, 10, 512)["INLINE_QUANT"] is False
    assert triton_fp8.plan(2, 10, 512, {"INLINE_QUANT": False})["INLINE_QUANT"] is False
    q13, s13, q2, s2 = make_experts(4, 256, 128, (128, 256), "cpu")
    x, w = torch.zeros(2, 256), torch.full((2, 2), 0.5)
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"INLINE_QUANT needs block\[1\] <= 128 .* got block\[1\]=256"):
        triton_fp8.moe_experts_fp8(x, w, ids, q13, s13, q2, s2, (128, 256), config={"INLINE_QUANT": True})


@pytest.mark.parametrize(("block_m", "num_warps", "num_stages"), [(16, 4, 4), (128, 8, 3)])
def test_moe_fp8_gemms_compile_for_sm90(block_m, num_warps, num_stages):
    """Both FP8 MoE GEMMs, with and without INLINE_QUANT, through Triton's NVIDIA pipeline for sm_90 (no
    GPU needed): they compile, and the inline form issues the same tensor-core instructions as the form
    that reads pre-quantised operands (same dots: the precondition of the equal outputs)."""
    pytest.importorskip("triton", reason="atom-kernels' Triton backend is optional: triton is not installed")
    import re

    import triton
    from atom_kernels.ops._triton_env import interpreting

    if interpreting():
        pytest.skip(
            "under TRITON_INTERPRET=1 the kernels are interpreted functions, which Triton cannot compile"
        )
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"Triton's compiler API is not importable here: {exc}")
    from atom_kernels.ops.moe import triton_fp8

    ints = ("num_pairs", "H", "inter", "stride_we", "stride_wn", "stride_se", "stride_sn")
    kernels = {  # kernel -> (activation pointer, its scale pointer, other arguments, extra constexprs)
        triton_fp8._moe_gemm1_fp8_kernel: ("x_ptr", "xs_ptr", ("act_ptr", "nb_inter", "stride_xt",
                                           "stride_xst", "stride_at"), dict(TOP_K=4)),
        triton_fp8._moe_gemm2_fp8_kernel: ("a_ptr", "as_ptr", ("y_ptr", "stride_at", "stride_ast",
                                           "stride_yt"), {}),
    }  # fmt: skip
    for fn, (a_name, s_name, other, extra) in kernels.items():
        ops = {}
        for inline in (False, True):
            sig = {a_name: "*bf16" if inline else "*fp8e4nv", s_name: "*bf16" if inline else "*fp32",
                   "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                   **{n: ("*bf16" if n.endswith("_ptr") else "i32") for n in other},
                   **dict.fromkeys(ints, "i32")}  # fmt: skip
            consts = dict(BN_Q=128, BK_Q=128, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, QUANT_A=inline,
                          EPS=1e-10, FMAX=448.0, **extra)  # fmt: skip
            src = ASTSource(fn, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)
            try:
                kernel = triton.compile(
                    src,
                    target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=num_warps, num_stages=num_stages),
                )
            except (RuntimeError, FileNotFoundError) as exc:
                if "ptxas" not in str(exc):
                    raise
                pytest.skip(f"no usable ptxas for sm_90 here: {exc}")
            assert kernel.asm["cubin"], "no cubin"
            ops[inline] = set(re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", kernel.asm["ptx"]))
        assert ops[True] and ops[True] == ops[False], f"{fn.fn.__name__}: {ops}"
