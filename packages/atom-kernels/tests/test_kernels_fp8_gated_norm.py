"""gated_norm_fp8_linear (the GDN output's gated RMS norm, then the FP8 block-scaled ``out_proj``): every
backend against a float64 composition; the Triton one-launch GATED_NORM kernel against the Triton
two-launch path (``gated_rms_norm`` + ``fp8_linear`` with the same tiles; on a GPU, or CPU under
``TRITON_INTERPRET=1``), its fallback to the two ops, its sm_90 compilation, CUDA-graph replays.

Tolerance. The norm's output is rounded to o.dtype and quantised per head (128 channels = one e4m3
group), so two implementations whose normed values differ in the last float32 bits (order of the sum of
squares, rsqrt, float64 vs float32) can round an activation to neighbouring e4m3 values (one step, up to
1/8 of its magnitude), and in bf16 a normed value can round to the neighbouring bf16 value, which moves
its group's scale when it is the group's max. A fixed tolerance that admits one such flip would be loose
(a step of a large activation times a large weight); instead :func:`_flip_slack` bounds, per output,
what every flip the float32 noise ``NORM_REL`` allows can change: each activation's dequantised value
over the corners of (its value +- ``NORM_REL`` rounded to o.dtype) x (its group's scale over the same
range), times ``|w|``. ``TOL`` (below) holds the rest: the linear's accumulation and output rounding.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from atom_kernels.testing import REPORT_ENV, randn

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
DV = 128
EPS = 1e-6
# Relative difference allowed between two implementations' float32 normed values before they are rounded
# to o.dtype (then it picks the e4m3 / bf16 neighbours :func:`_flip_slack` admits): sum of 128 squares,
# rsqrt, three products, silu; a few ulps (2^-23) each. Measured (reference vs float64, CPU): 2.8e-07.
NORM_REL = 2**-18
# (what, dtype[, backend]) -> (atol, rtol) on top of the flip slack; measured max abs error in the comments
# (the largest over the M x Hv x N grid).
TOL = {
    # float32 products of the same quantised operands, float64 expected: summation order only
    ("linear", torch.float32): (1e-5, 1e-5),  # measured 1.6e-06 (reference, CPU)
    ("linear", torch.bfloat16): (2e-2, 1e-2),  # measured 1.4e-02 (reference, CPU): bf16 output rounding
    # Hopper's e4m3 dots accumulate below float32 inside one K tile (test_kernels_fp8's "linear" triton
    # entry, measured 9.7e-04 there); this op on the H200: float32 max abs 5.0e-07, bf16 1.4e-02
    ("linear", torch.float32, "triton"): (2e-3, 1e-3),
    # one launch vs two launches with the same tiles: the same products in the same order, unless a
    # normed value differs in its last bits (e4m3 flips and group-scale ulps: in the slack); the rest is
    # float32 rounding of the two sums. Measured (interpreter, CPU): 4.8e-07 (float32, SWAP_AB).
    ("plans", torch.float32): (1e-6, 1e-6),
    # the two bf16 outputs may round to neighbours: one bf16 ulp, <= 2^-7 relative. Measured: 0.0
    ("plans", torch.bfloat16): (0.0, 2**-7),
}
DTYPES = [torch.float32, torch.bfloat16]
MS = [1, 2, 8]
HVS = [2, 4, 32]
NS = [256, 2048]


def _tol(what: str, dtype: torch.dtype, backend: str = "reference") -> tuple[float, float]:
    return TOL.get((what, dtype, backend), TOL[(what, dtype)])


@functools.cache
def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` e4m3 weight with 128 x 128 block scales (CPU; cached across the cases)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    t = w.reshape(n // 128, 128, k // 128, 128)
    s = t.abs().amax((1, 3)).clamp(min=1e-12) / FP8_MAX
    return (t / s[:, None, :, None]).reshape(n, k).to(E4M3), s


def _case(device, m: int, hv: int, n: int, dtype: torch.dtype, bias: bool = False, seed: int = 7):
    """``o [M, Hv, 128]`` (head 0 of token 0 all zeros: rms 0, the scale floor), the gate ``z`` as a view of
    a wider projection output (row-strided, like the model's), the norm weight, the weight, the bias."""
    k = hv * DV
    o = randn(m, hv, DV, seed=seed, dtype=dtype, device=device)
    o[0, 0] = 0.0
    proj = randn(m, 3 * k, seed=seed + 1, dtype=dtype, device=device)
    z = proj[:, 2 * k :].unflatten(-1, (hv, DV))
    norm_w = (1.0 + 0.1 * randn(DV, seed=seed + 2, dtype=torch.float32, device=device)).to(dtype)
    w_fp8, scale_inv = (t.to(device) for t in _weight(n, k, seed + 3))
    b = randn(n, seed=seed + 4, dtype=dtype, device=device) if bias else None
    return o, z, norm_w, w_fp8, scale_inv, b


def _normed64(o, z, norm_w) -> torch.Tensor:
    x, g = o.double(), z.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.double() * (g * torch.sigmoid(g))


def _qdq(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """e4m3 quantise-dequantise of float64 ``x [..., G, 128]`` with the group scales ``s [..., G, 1]``."""
    return (x / s).float().clamp(-FP8_MAX, FP8_MAX).to(E4M3).double() * s


def _group_scale(x: torch.Tensor) -> torch.Tensor:
    """``fp8_act_quant``'s scale (float32 math) of float64 groups ``x [..., G, 128]`` -> ``[..., G, 1]``."""
    return (x.float().abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX).double()


def _flip_slack(normed64: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(center, slack)``, both ``[M, K]`` float64: ``center`` = the dequantised activations of the float64
    composition (the normed values rounded to ``dtype``, quantised per head), ``slack`` = per activation
    the largest change of its dequantised value that a relative perturbation ``NORM_REL`` of the normed
    values allows (its own rounding, and its group's scale through the group's max)."""
    c = normed64.to(dtype).double()
    lo = (normed64 * (1 - NORM_REL)).to(dtype).double()
    hi = (normed64 * (1 + NORM_REL)).to(dtype).double()
    lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)
    s_c = _group_scale(c)
    s_lo = _group_scale(torch.where(lo * hi <= 0, 0.0, torch.minimum(lo.abs(), hi.abs())))
    s_hi = _group_scale(torch.maximum(lo.abs(), hi.abs()))
    center = _qdq(c, s_c)
    slack = torch.zeros_like(center)
    for x in (lo, hi):
        for s in (s_lo * (1 - 2**-22), s_hi * (1 + 2**-22)):  # the scale's own float32 rounding
            slack = torch.maximum(slack, (_qdq(x, s) - center).abs())
    return center.flatten(-2), slack.flatten(-2)


def _expected(o, z, norm_w, w_fp8, scale_inv, b, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 composition ``(y [M, N], slack [M, N])`` on the CPU (see :func:`_flip_slack`)."""
    o, z, norm_w = o.cpu(), z.cpu(), norm_w.cpu()
    n, k = w_fp8.shape
    w64 = w_fp8.cpu().double() * scale_inv.cpu().double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    x, slack = _flip_slack(_normed64(o, z, norm_w), dtype)
    y = x @ w64.t() + (b.cpu().double() if b is not None else 0)
    return y, slack @ w64.abs().t()


def _assert_within(y, expected, slack, tol, what: str) -> None:
    """``|y - expected| <= atol + rtol |expected| + slack`` elementwise."""
    atol, rtol = tol
    err = (y.double().cpu() - expected).abs()
    bound = atol + rtol * expected.abs() + slack
    if os.environ.get(REPORT_ENV) == "1":  # measuring TOL: pytest -s shows these lines
        print(f"\n[max-error] {what}: abs {err.max():.2e}, slack max {slack.max():.2e}, "
              f"over (atol + rtol |e|) {(err - bound + slack).max():.2e}")  # fmt: skip
    bad = err > bound
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {y.numel()} outputs out of bounds; max |err| {err.max():.3e}, "
        f"max |err| - bound {(err - bound).max():.3e} (atol {atol:g}, rtol {rtol:g}, max slack {slack.max():.2e})"
    )


# --- every backend against the float64 composition ---------------------------------------------------
def test_norm_rel_covers_reference_norm(device):
    """The reference's float32 normed values stay within ``NORM_REL`` (relative) of the float64 ones, which
    the flip slack assumes (measured 2.8e-07)."""
    from atom_kernels.ops.norm.reference import gated_rms_norm

    o, z, norm_w, *_ = _case(device, 8, 32, 256, torch.float32)
    n64 = _normed64(o.cpu(), z.cpu(), norm_w.cpu())
    n32 = gated_rms_norm(o, z, norm_w, EPS).cpu().double()
    rel = ((n32 - n64).abs() / n64.abs().clamp(min=1e-30)).max().item()
    assert rel <= NORM_REL, f"reference norm rel. error {rel:.2e} > NORM_REL {NORM_REL:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("hv", HVS)
@pytest.mark.parametrize("m", MS)
def test_gated_norm_fp8_linear(impl, backend, device, dtype, m, hv, n):
    op = impl("gated_norm_fp8_linear", dtype)
    o, z, norm_w, w_fp8, scale_inv, b = _case(device, m, hv, n, dtype, bias=n == 256)
    y = op(o, z, norm_w, EPS, w_fp8, scale_inv, (128, 128), b)
    assert y.shape == (m, n) and y.dtype == dtype
    expected, slack = _expected(o, z, norm_w, w_fp8, scale_inv, b, dtype)
    what = f"gated_norm_fp8_linear {backend} M={m} Hv={hv} N={n} {dtype}"
    _assert_within(y, expected, slack, _tol("linear", dtype, backend), what)


def test_reference_is_norm_then_linear(device):
    """The reference is ``gated_rms_norm`` then ``fp8_linear`` (bit for bit), with leading dims kept."""
    from atom_kernels.ops.fp8 import reference as fp8_ref
    from atom_kernels.ops.norm import reference as norm_ref

    o, z, norm_w, w_fp8, scale_inv, b = _case(device, 6, 4, 256, torch.bfloat16, bias=True)
    y = fp8_ref.gated_norm_fp8_linear(o.view(2, 3, 4, DV), z.reshape(2, 3, 4, DV), norm_w, EPS, w_fp8,
                                      scale_inv, (128, 128), b)  # fmt: skip
    two = fp8_ref.fp8_linear(norm_ref.gated_rms_norm(o, z, norm_w, EPS).flatten(-2), w_fp8, scale_inv,
                             (128, 128), b)  # fmt: skip
    assert y.shape == (2, 3, 256) and torch.equal(y.reshape(6, 256), two)


def test_bad_inputs(impl, device):
    op = impl("gated_norm_fp8_linear", torch.float32)
    o, z, norm_w, w_fp8, scale_inv, _ = _case(device, 2, 2, 256, torch.float32)
    with pytest.raises(ValueError, match=r"z must have shape \[2, 2, 128\]"):
        op(o, z[:, :1], norm_w, EPS, w_fp8, scale_inv)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \[Dv=128\]"):
        op(o, z, norm_w[:64], EPS, w_fp8, scale_inv)
    with pytest.raises(ValueError, match=r"w_fp8 must have shape \[N, Hv\*Dv=256\]"):
        op(o, z, norm_w, EPS, w_fp8[:, :128], scale_inv)
    with pytest.raises(ValueError, match="eps must be a positive"):
        op(o, z, norm_w, 0.0, w_fp8, scale_inv)
    with pytest.raises(ValueError, match=r"tickets holds 8 counters, needs >= 16 \(N / 16\)"):
        op(o, z, norm_w, EPS, w_fp8, scale_inv, tickets=torch.zeros(8, dtype=torch.int32, device=device))


# --- the Triton kernel: one launch vs two launches ---------------------------------------------------
def _triton(device: torch.device):
    """The Triton FP8 module, where it can run: a GPU, or CPU under TRITON_INTERPRET=1 (these tests compare
    its kernels with each other, so the interpreter's e4m3 rounding defects cancel)."""
    pytest.importorskip("triton", reason="atom-kernels' Triton backend is optional: triton is not installed")
    from atom_kernels.ops._triton_env import interpreting

    if device.type != "cuda" and not interpreting():
        pytest.skip("the Triton kernels run on a GPU, or on CPU under TRITON_INTERPRET=1")
    from atom_kernels.ops.fp8 import triton as fp8_triton

    return fp8_triton


def _one_launch(swap: bool, rows: int, split: int) -> dict:
    return dict(ONE_LAUNCH=True, ROWS=rows, BLOCK_N=32, SPLIT_K=split, SWAP_AB=swap,
                num_warps=2 if swap else 4, num_stages=4)  # fmt: skip


def _interpreted_shapes(device, hv: int, n: int) -> None:
    if device.type != "cuda" and hv * n > 4 * 256:
        pytest.skip("the interpreter takes the small shapes only (K x N <= 512 x 256; ~1 s a case)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "swap, split", [(True, 1), (True, 2), (False, 2)], ids=["swap", "swap-splitK", "mma-splitK"]
)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("hv", HVS)
@pytest.mark.parametrize("m", MS)
def test_one_launch_vs_two_launches(device, dtype, m, hv, n, swap, split):
    """The GATED_NORM kernel against ``gated_rms_norm`` + the one-launch ``fp8_linear`` with the same tiles
    and split: the same quantised operands (so the same products, in the same order) unless a normed value
    differs in its last bits (the two kernels sum the squares in their own order) and flips an e4m3 step."""
    fp8_triton = _triton(device)
    _interpreted_shapes(device, hv, n)
    from atom_kernels.ops.norm import triton as norm_triton

    o, z, norm_w, w_fp8, scale_inv, b = _case(device, m, hv, n, dtype, bias=split > 1)
    cfg = _one_launch(swap, max(2, m) if swap else 16, split)
    fused = fp8_triton.gated_norm_fp8_linear(o, z, norm_w, EPS, w_fp8, scale_inv, (128, 128), b, config=cfg)
    normed = norm_triton.gated_rms_norm(o, z, norm_w, EPS)
    two = fp8_triton.fp8_linear(normed.flatten(-2), w_fp8, scale_inv, (128, 128), b, config=cfg)
    assert fused.shape == (m, n) and fused.dtype == dtype
    w64 = w_fp8.cpu().double() * scale_inv.cpu().double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    # the slack around the two-launch path's activations: its norm kernel's float32 values (before the
    # rounding to dtype: the same kernel on float32 inputs)
    normed32 = norm_triton.gated_rms_norm(o.float(), z.float(), norm_w.float(), EPS)
    _, slack = _flip_slack(normed32.cpu().double(), dtype)
    what = f"one launch vs two M={m} Hv={hv} N={n} swap={swap} split={split} {dtype}"
    _assert_within(fused, two.cpu().double(), slack @ w64.abs().t(), _tol("plans", dtype), what)


@pytest.mark.parametrize("m, config", [(8, None), (2, {"ONE_LAUNCH": False})], ids=["M=8 default", "forced"])
def test_other_plans_run_the_two_ops(device, m, config):
    """Where the plan is not the one-launch kernel, the op is ``gated_rms_norm`` + ``fp8_linear`` (bit for
    bit); also for heads narrower than the activation group (Dv = 64 < bk = 128)."""
    fp8_triton = _triton(device)
    from atom_kernels.ops.norm import triton as norm_triton

    o, z, norm_w, w_fp8, scale_inv, b = _case(device, m, 2, 256, torch.float32, bias=True)
    y = fp8_triton.gated_norm_fp8_linear(o, z, norm_w, EPS, w_fp8, scale_inv, (128, 128), b, config=config)
    two = fp8_triton.fp8_linear(norm_triton.gated_rms_norm(o, z, norm_w, EPS).flatten(-2), w_fp8, scale_inv,
                                (128, 128), b, config=config)  # fmt: skip
    assert torch.equal(y, two), "the fallback differs from gated_rms_norm + fp8_linear"
    o64, z64 = o.reshape(m, 4, 64), z.reshape(m, 4, 64)
    y = fp8_triton.gated_norm_fp8_linear(o64, z64, norm_w[:64], EPS, w_fp8, scale_inv, (128, 128), b,
                                         config={"ONE_LAUNCH": True})  # fmt: skip
    two = fp8_triton.fp8_linear(norm_triton.gated_rms_norm(o64, z64, norm_w[:64], EPS).flatten(-2), w_fp8,
                                scale_inv, (128, 128), b, config={"ONE_LAUNCH": True})  # fmt: skip
    assert torch.equal(y, two), "Dv != bk: the op must run the two ops"


def test_one_launch_in_cuda_graph_with_tickets(device):
    """The default (one-launch, split-K) plan at the out_proj shape with the caller's tickets, captured in
    a CUDA graph: replays give the eager result and leave the tickets zero."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need --device cuda")
    fp8_triton = _triton(device)
    o, z, norm_w, w_fp8, scale_inv, _ = _case(device, 2, 32, 2048, torch.bfloat16)
    tickets = torch.zeros(2048 // 16, dtype=torch.int32, device=device)

    def call():
        return fp8_triton.gated_norm_fp8_linear(o, z, norm_w, EPS, w_fp8, scale_inv, tickets=tickets)

    assert fp8_triton.plan(2, 2048, 4096, 128, 132)["SPLIT_K"] > 1
    eager = call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "graph replay differs from the eager call"
    assert int(tickets.abs().sum()) == 0, "tickets not left zero"


@pytest.mark.parametrize("rows, swap, split", [(2, True, True), (8, True, False), (16, False, True)])
def test_gated_norm_kernel_compiles_for_sm90(rows, swap, split):
    """The GATED_NORM kernel through Triton's NVIDIA pipeline for sm_90 (no GPU needed); with GATED_NORM
    off the PTX is that of the plain kernel (the prologue is compiled out), with it on the gate's sigmoid
    (``ex2``) appears."""
    pytest.importorskip("triton", reason="atom-kernels' Triton backend is optional: triton is not installed")
    from atom_kernels.ops._triton_env import interpreting

    if interpreting():
        pytest.skip(
            "under TRITON_INTERPRET=1 the kernels are interpreted functions, which Triton cannot compile"
        )
    import triton
    from atom_kernels.ops.fp8 import triton_decode
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", y_ptr="*bf16", bias_ptr="*bf16",
               part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", K="i32", stride_xm="i32",
               stride_wn="i32", stride_wsn="i32", stride_ym="i32", GROUPS_PER_SPLIT="i32",
               SPLIT_K="i32", z_ptr="*bf16", nw_ptr="*bf16", stride_zm="i32", res_ptr="*bf16",
               h_ptr="*bf16", yn_ptr="*bf16", stride_rm="i32", stride_hm="i32", stride_ynm="i32")  # fmt: skip
    ptx = {}
    for gated in (False, True):
        consts = dict(EPS=1e-10, FMAX=448.0, BN_Q=128, GROUP=128, ROWS=rows, BLOCK_N=32, SWAP_AB=swap,
                      EVEN_K=True, SPLIT=split, HAS_BIAS=False, PDL=rows == 2, GATED_NORM=gated,
                      NORM_EPS=1e-6 if gated else 0.0, RMS_NORM=False, HAS_RES=False, SS_BLOCK=128)  # fmt: skip
        src = ASTSource(
            triton_decode._fp8_linear_decode_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts
        )
        try:
            kernel = triton.compile(
                src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=4)
            )
        except (RuntimeError, FileNotFoundError) as exc:
            if "ptxas" not in str(exc):
                raise
            pytest.skip(f"no usable ptxas for sm_90 here: {exc}")
        assert kernel.asm["cubin"], "no cubin"
        ptx[gated] = kernel.asm["ptx"]
    assert "ex2" in ptx[True] and "rsqrt" in ptx[True], "GATED_NORM prologue missing"
    assert "rsqrt" not in ptx[False], "the plain kernel carries the prologue"
