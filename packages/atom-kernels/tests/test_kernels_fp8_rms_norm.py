"""rms_norm_fp8_linear (the decoder layer's residual add and zero-centred RMS norm, then an FP8 block-scaled
projection): every backend against a float64 composition; the Triton one-launch RMS_NORM kernel against the
Triton two-launch path (``rms_norm`` + ``fp8_linear`` with the same tiles; on a GPU, or CPU under
``TRITON_INTERPRET=1``), its fallback to the two ops, its sm_90 compilation, CUDA-graph replays.

Tolerance. The normed row is rounded to x.dtype and quantised per 128-channel group, so two implementations
whose normed values differ in the last float32 bits (order of the sum of squares, rsqrt, float64 vs float32)
can round an activation to neighbouring e4m3 values, and in bf16 to the neighbouring bf16 value, which moves
its group's scale when it is the group's max. :func:`_flip_slack` bounds, per output, what every such flip
within the float32 noise ``NORM_REL`` can change (each activation's dequantised value over the corners of
its value +- ``NORM_REL`` rounded to x.dtype and its group's scale over the same range, times ``|w|``);
``TOL`` holds the rest. The one-launch kernel's output is also checked bit for bit against ``fp8_linear``
of the normed rows it returns (the same operands, tiles and order), and its new residual ``h`` exactly.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from atom_kernels.testing import REPORT_ENV, randn, row_strided

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-6
# Relative difference allowed between two implementations' float32 normed values before they are rounded
# to x.dtype: a sum of K squares in another order, rsqrt, two products. Measured (reference vs float64,
# CPU, K = 2048): 2.6e-07.
NORM_REL = 2**-18
# (what, dtype[, backend]) -> (atol, rtol) on top of the flip slack; measured max abs error in the comments.
TOL = {
    # float32 products of the same quantised operands, float64 expected: summation order only
    ("linear", torch.float32): (1e-5, 1e-5),  # measured 1.8e-06 (reference, CPU)
    ("linear", torch.bfloat16): (2e-2, 1e-2),  # measured 1.5e-02 (reference, CPU): bf16 output rounding
    # Hopper's e4m3 dots accumulate below float32 inside one K tile (test_kernels_fp8's "linear" triton
    # entry, measured 9.7e-04 there)
    ("linear", torch.float32, "triton"): (2e-3, 1e-3),
    # the normed rows of one launch vs the norm kernel's: float32 order of the sum of squares (NORM_REL);
    # bf16: one bf16 ulp (2^-7 relative) where the float32 values straddle a rounding boundary.
    # Measured (interpreter, CPU): float32 max abs 7.2e-07 (values up to ~5), bf16 1.2e-02 (one ulp)
    ("normed", torch.float32): (0.0, NORM_REL),
    ("normed", torch.bfloat16): (0.0, 2**-7),
    # one launch vs two launches with the same tiles: the same products in the same order, unless a normed
    # value differs in its last bits (in the slack); the rest is float32 rounding of the sums.
    # Measured (interpreter, CPU): float32 max abs 1.8e-06, bf16 1.5e-02 (one ulp of a large output)
    ("plans", torch.float32): (1e-6, 1e-6),
    ("plans", torch.bfloat16): (0.0, 2**-7),
}
DTYPES = [torch.float32, torch.bfloat16]
MS = [1, 2, 8]
RESIDUALS = ["none", "float32", "same"]


def _tol(what: str, dtype: torch.dtype, backend: str = "reference") -> tuple[float, float]:
    return TOL.get((what, dtype, backend), TOL[(what, dtype)])


@functools.cache
def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` e4m3 weight with 128 x 128 block scales (partial edge blocks; CPU, cached)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    nb, kb = -(-n // 128), -(-k // 128)
    t = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).reshape(nb, 128, kb, 128)
    s = t.abs().amax((1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (t / s[:, None, :, None]).reshape(nb * 128, kb * 128)[:n, :k]
    return q.to(E4M3), s


def _case(
    device, m: int, k: int, n: int, dtype: torch.dtype, residual: str, bias: bool = False, seed: int = 11
):
    """``x [M, K]`` (a row-strided view whose neighbours are NaN), the residual (None, float32 or
    x.dtype; row 0 of x + residual all zeros when given: rms 0, the scale floor), the zero-centred norm
    weight, the weight, the bias."""
    x = row_strided(randn(m, k, seed=seed, dtype=dtype, device=device, scale=2.0))
    res = None
    if residual != "none":
        res = randn(
            m, k, seed=seed + 1, dtype=torch.float32 if residual == "float32" else dtype, device=device
        )
        res[0] = -x[0].to(res.dtype)
    norm_w = (0.1 * randn(k, seed=seed + 2, dtype=torch.float32, device=device)).to(dtype)
    w_fp8, scale_inv = (t.to(device) for t in _weight(n, k, seed + 3))
    b = randn(n, seed=seed + 4, dtype=dtype, device=device) if bias else None
    return x, res, norm_w, w_fp8, scale_inv, b


def _h64(x, res) -> torch.Tensor:
    return x.cpu().double() + (0 if res is None else res.cpu().double())


def _normed64(x, res, norm_w) -> torch.Tensor:
    h = _h64(x, res)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + norm_w.cpu().double())


def _groups(x: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` -> ``[M, G, 128]`` (zero-padded)."""
    k = x.shape[-1]
    g = -(-k // 128)
    return torch.nn.functional.pad(x, (0, g * 128 - k)).reshape(x.shape[0], g, 128)


def _qdq(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x / s).float().clamp(-FP8_MAX, FP8_MAX).to(E4M3).double() * s


def _group_scale(x: torch.Tensor) -> torch.Tensor:
    return (x.float().abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX).double()


def _flip_slack(normed64: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(center, slack)`` ``[M, K]`` float64: the dequantised activations of the float64 normed rows
    (rounded to ``dtype``, quantised per group) and, per activation, the largest change of its dequantised
    value that a relative perturbation ``NORM_REL`` of the normed values allows."""
    k = normed64.shape[-1]
    c = _groups(normed64.to(dtype).double())
    lo = _groups((normed64 * (1 - NORM_REL)).to(dtype).double())
    hi = _groups((normed64 * (1 + NORM_REL)).to(dtype).double())
    lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)
    s_c = _group_scale(c)
    s_lo = _group_scale(torch.where(lo * hi <= 0, 0.0, torch.minimum(lo.abs(), hi.abs())))
    s_hi = _group_scale(torch.maximum(lo.abs(), hi.abs()))
    center = _qdq(c, s_c)
    slack = torch.zeros_like(center)
    for v in (lo, hi):
        for s in (s_lo * (1 - 2**-22), s_hi * (1 + 2**-22)):  # the scale's own float32 rounding
            slack = torch.maximum(slack, (_qdq(v, s) - center).abs())
    return center.flatten(-2)[:, :k], slack.flatten(-2)[:, :k]


def _w64(w_fp8, scale_inv) -> torch.Tensor:
    n, k = w_fp8.shape
    s = scale_inv.cpu().double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return w_fp8.cpu().double() * s


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


def _check_h(h, x, res, what: str) -> None:
    """``h`` is ``x + residual`` in float32, rounded to residual.dtype: exact."""
    assert h.dtype == res.dtype and h.shape == x.shape, f"{what}: h {h.dtype} {tuple(h.shape)}"
    expected = (x.float() + res.float()).to(res.dtype)
    assert torch.equal(h.cpu(), expected.cpu()), f"{what}: h differs from x + residual"


# --- every backend against the float64 composition ---------------------------------------------------
def test_norm_rel_covers_reference_norm(device):
    """The reference's float32 normed values stay within ``NORM_REL`` of the float64 ones (measured 2.4e-07)."""
    from atom_kernels.ops.norm.reference import rms_norm

    x, res, norm_w, *_ = _case(device, 8, 2048, 256, torch.float32, "float32")
    n32, _ = rms_norm(x, norm_w, EPS, res)
    n64 = _normed64(x, res, norm_w)
    rel = ((n32.cpu().double() - n64).abs() / n64.abs().clamp(min=1e-30))[1:].max().item()
    assert rel <= NORM_REL, f"reference norm rel. error {rel:.2e} > NORM_REL {NORM_REL:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("k, n", [(2048, 256), (320, 192)], ids=["K=2048", "K=320 partial blocks"])
@pytest.mark.parametrize("m", MS)
def test_rms_norm_fp8_linear(impl, backend, device, dtype, m, k, n, residual):
    op = impl("rms_norm_fp8_linear", dtype)
    x, res, norm_w, w_fp8, scale_inv, b = _case(device, m, k, n, dtype, residual, bias=m == 2)
    out = op(x, norm_w, EPS, w_fp8, scale_inv, (128, 128), b, res)
    assert len(out) == (2 if res is None else 3)
    y, normed = out[0], out[1]
    assert y.shape == (m, n) and y.dtype == dtype and normed.shape == (m, k) and normed.dtype == dtype
    what = f"rms_norm_fp8_linear {backend} M={m} K={k} N={n} residual={residual} {dtype}"
    if res is not None:
        _check_h(out[2], x, res, what)
    n64 = _normed64(x, res, norm_w)
    _assert_within(normed, n64, torch.zeros_like(n64), (0.0, NORM_REL + 2**-24 if dtype == torch.float32
                                                          else 2**-8), what + " normed")  # fmt: skip
    center, slack = _flip_slack(n64, dtype)
    w64 = _w64(w_fp8, scale_inv)
    expected = center @ w64.t() + (b.cpu().double() if b is not None else 0)
    _assert_within(y, expected, slack @ w64.abs().t(), _tol("linear", dtype, backend), what)


def test_reference_is_norm_then_linear(device):
    """The reference is ``rms_norm`` then ``fp8_linear`` (bit for bit), with leading dims kept."""
    from atom_kernels.ops.fp8 import reference as fp8_ref
    from atom_kernels.ops.norm import reference as norm_ref

    x, res, norm_w, w_fp8, scale_inv, b = _case(device, 6, 256, 256, torch.bfloat16, "float32", bias=True)
    y, normed, h = fp8_ref.rms_norm_fp8_linear(x.reshape(2, 3, 256), norm_w, EPS, w_fp8, scale_inv, (128, 128),
                                               b, res.reshape(2, 3, 256))  # fmt: skip
    n2, h2 = norm_ref.rms_norm(x, norm_w, EPS, res)
    two = fp8_ref.fp8_linear(n2, w_fp8, scale_inv, (128, 128), b)
    assert y.shape == (2, 3, 256) and torch.equal(y.reshape(6, 256), two)
    assert torch.equal(normed.reshape(6, 256), n2) and torch.equal(h.reshape(6, 256), h2)


def test_bad_inputs(impl, device):
    op = impl("rms_norm_fp8_linear", torch.float32)
    x, res, norm_w, w_fp8, scale_inv, _ = _case(device, 2, 256, 256, torch.float32, "float32")
    with pytest.raises(ValueError, match=r"residual must have shape \[2, 256\]"):
        op(x, norm_w, EPS, w_fp8, scale_inv, residual=res[:1])
    with pytest.raises(ValueError, match=r"residual must have x's dtype"):
        op(x, norm_w, EPS, w_fp8, scale_inv, residual=res.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"norm_weight must have shape \[K=256\]"):
        op(x, norm_w[:128], EPS, w_fp8, scale_inv)
    with pytest.raises(ValueError, match=r"w_fp8 must have shape \[N, K=256\]"):
        op(x, norm_w, EPS, w_fp8[:, :128], scale_inv)
    with pytest.raises(ValueError, match="eps must be a positive"):
        op(x, norm_w, 0.0, w_fp8, scale_inv)
    with pytest.raises(ValueError, match=r"tickets holds 8 counters, needs >= 16 \(N / 16\)"):
        op(x, norm_w, EPS, w_fp8, scale_inv, tickets=torch.zeros(8, dtype=torch.int32, device=device))


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "swap, split", [(True, 1), (True, 2), (False, 2)], ids=["swap", "swap-splitK", "mma-splitK"]
)
@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("k", [512, 320], ids=["K=512", "K=320"])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_one_launch_vs_two_launches(device, dtype, m, k, residual, swap, split):
    """The RMS_NORM kernel against ``rms_norm`` + the one-launch ``fp8_linear`` with the same tiles and
    split: ``h`` equal to the norm kernel's (and to ``x + residual`` rounded as torch rounds, except for a
    bf16 ``h`` under the interpreter, whose float32 -> bf16 conversion truncates); the normed rows within the float32 noise of the sum of squares' order; the output
    equal to ``fp8_linear`` of the normed rows it returns (bit for bit: the same operands, products and
    order), and within the flip slack of the two-launch output."""
    fp8_triton = _triton(device)
    from atom_kernels.ops.norm import triton as norm_triton

    n = 256 if device.type != "cuda" else 2048  # the interpreter takes ~1 s a case at K x N = 512 x 256
    x, res, norm_w, w_fp8, scale_inv, b = _case(device, m, k, n, dtype, residual, bias=split > 1)
    cfg = _one_launch(swap, max(2, m) if swap else 16, split)
    out = fp8_triton.rms_norm_fp8_linear(x, norm_w, EPS, w_fp8, scale_inv, (128, 128), b, res, config=cfg)
    fused, normed = out[0], out[1]
    what = f"one launch vs two M={m} K={k} residual={residual} swap={swap} split={split} {dtype}"
    assert fused.shape == (m, n) and fused.dtype == dtype and normed.shape == (m, k) and normed.dtype == dtype
    again = fp8_triton.fp8_linear(normed, w_fp8, scale_inv, (128, 128), b, config=cfg)
    assert torch.equal(fused, again), f"{what}: the output is not fp8_linear of the normed rows returned"
    two_normed = norm_triton.rms_norm(x, norm_w, EPS, res)
    if res is not None:
        two_normed, two_h = two_normed
        assert torch.equal(out[2], two_h), f"{what}: h differs from the norm kernel's"
        if device.type == "cuda" or res.dtype == torch.float32:  # the interpreter truncates float32 -> bf16
            _check_h(out[2], x, res, what)
    zero = torch.zeros(m, k, dtype=torch.float64)
    _assert_within(normed, two_normed.cpu().double(), zero, _tol("normed", dtype), what + " normed")
    two = fp8_triton.fp8_linear(two_normed, w_fp8, scale_inv, (128, 128), b, config=cfg)
    # the slack around the two-launch path's activations: its norm kernel's float32 values
    n32 = norm_triton.rms_norm(x.float(), norm_w.float(), EPS, None if res is None else res.float())
    n32 = n32 if res is None else n32[0]
    _, slack = _flip_slack(n32.cpu().double(), dtype)
    _assert_within(
        fused, two.cpu().double(), slack @ _w64(w_fp8, scale_inv).abs().t(), _tol("plans", dtype), what
    )


@pytest.mark.parametrize("m, config", [(8, None), (2, {"ONE_LAUNCH": False})], ids=["M=8 default", "forced"])
def test_other_plans_run_the_two_ops(device, m, config):
    """Where the plan is not the one-launch kernel, the op is ``rms_norm`` + ``fp8_linear`` (bit for bit)."""
    fp8_triton = _triton(device)
    from atom_kernels.ops.norm import triton as norm_triton

    x, res, norm_w, w_fp8, scale_inv, b = _case(device, m, 256, 256, torch.float32, "float32", bias=True)
    assert not fp8_triton.plan(m, 256, 256, 128, 132, config, {})["ONE_LAUNCH"]
    y, normed, h = fp8_triton.rms_norm_fp8_linear(x, norm_w, EPS, w_fp8, scale_inv, (128, 128), b, res,
                                                  config=config, table={})  # fmt: skip
    n2, h2 = norm_triton.rms_norm(x, norm_w, EPS, res)
    two = fp8_triton.fp8_linear(n2, w_fp8, scale_inv, (128, 128), b, config=config, table={})
    assert torch.equal(y, two) and torch.equal(normed, n2) and torch.equal(h, h2), "fallback differs"


def test_one_launch_in_cuda_graph_with_tickets(device):
    """The default (one-launch, split-K) plan at the in_proj_qkvz shape with the caller's tickets, captured
    in a CUDA graph: replays give the eager result and leave the tickets zero."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need --device cuda")
    fp8_triton = _triton(device)
    x, res, norm_w, w_fp8, scale_inv, _ = _case(device, 1, 2048, 12288, torch.bfloat16, "float32")
    tickets = torch.zeros(12288 // 16, dtype=torch.int32, device=device)

    def call():
        return fp8_triton.rms_norm_fp8_linear(x, norm_w, EPS, w_fp8, scale_inv, residual=res, tickets=tickets)

    eager = call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call()
    for _ in range(3):
        for t in outs:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, eager)), "graph replay differs from the eager call"
    assert int(tickets.abs().sum()) == 0, "tickets not left zero"


@pytest.mark.parametrize("rows, swap, split, res, one", [(2, True, True, True, ()), (2, True, True, True, ("M",)),
                                                         (8, True, False, False, ()),
                                                         (16, False, True, True, ())])  # fmt: skip
def test_rms_norm_kernel_compiles_for_sm90(rows, swap, split, res, one):
    """The RMS_NORM kernel through Triton's NVIDIA pipeline for sm_90 (no GPU needed): the prologue's
    ``rsqrt`` appears with RMS_NORM on, not without. ``one``: int arguments equal to 1, which Triton
    passes as constexprs (M = 1)."""
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
               SPLIT_K="i32", z_ptr="*bf16", nw_ptr="*bf16", stride_zm="i32", res_ptr="*fp32",
               h_ptr="*fp32", yn_ptr="*bf16", stride_rm="i32", stride_hm="i32", stride_ynm="i32")  # fmt: skip
    ptx = {}
    for on in (False, True):
        consts = dict(EPS=1e-10, FMAX=448.0, BN_Q=128, GROUP=128, ROWS=rows, BLOCK_N=32, SWAP_AB=swap,
                      EVEN_K=True, SPLIT=split, HAS_BIAS=False, PDL=rows == 2, GATED_NORM=False,
                      NORM_EPS=1e-6 if on else 0.0, RMS_NORM=on, HAS_RES=on and res,
                      SS_BLOCK=max(128, 2048 // rows), **dict.fromkeys(one, 1))  # fmt: skip
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
        ptx[on] = kernel.asm["ptx"]
    assert "rsqrt" in ptx[True], "RMS_NORM prologue missing"
    assert "rsqrt" not in ptx[False], "the plain kernel carries the prologue"
