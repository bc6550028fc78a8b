"""FP8 e4m3: block dequant round trip, activation quant, block-scaled linear, KV quant; the Triton
linear's launch plans (selection on CPU, sm_90 compilation where Triton's ptxas is present, conformance
and plan-against-plan equality on a GPU)."""

from __future__ import annotations

import functools

import pytest
import torch
from atom_kernels.testing import assert_close, randn

E4M3 = torch.float8_e4m3fn
# e4m3 round to nearest: relative error <= 2^-4 in the normal range, absolute <= scale * 2^-10 below it.
# (what, dtype) -> (atol, rtol); measured max abs error in the comments.
TOL = {
    # compared in units of each block's scale (w / scale), so the subnormal bound is 2^-10:
    ("roundtrip", torch.float32): (
        2**-10,
        2**-4,
    ),  # measured 1.6e+01 fp8 units at |w / scale| ~ 448 (rel 3.5e-02)
    ("dequant_exact", torch.float32): (
        0.0,
        2**-23,
    ),  # measured rel 3.2e-08: one float32 rounding of w * scale
    ("dequant_exact", torch.bfloat16): (
        0.0,
        2**-8,
    ),  # measured 6.2e-02 at |w| ~ 30 (rel 2.1e-03): one bf16 rounding
    ("act_roundtrip", torch.float32): (2e-5, 2**-4),  # measured 1.1e-01 at |x| ~ 3 (rel 3.5e-02)
    ("act_roundtrip", torch.bfloat16): (2e-5, 2**-4),  # measured 1.1e-01 (rel 3.4e-02)
    ("linear", torch.float32): (1e-5, 1e-5),  # measured 1.2e-06 (|y| up to ~4)
    # Hopper's e4m3 tensor-core dot accumulates below float32 precision inside one 128-wide K tile
    # (Triton's default on sm_90, as vLLM's block-FP8 kernel): measured 9.7e-04 (rel 2.7e-04), H200
    ("linear", torch.float32, "triton"): (2e-3, 1e-3),
    ("linear", torch.bfloat16): (2e-2, 1e-2),  # measured 1.5e-02 (rel 2.9e-03: bf16 output rounding)
    ("kv", torch.float32): (0.05 * 2**-10, 2**-4),  # measured 1.6e-01 (rel 4.7e-02)
    # one-launch vs three-launch plan, same quantised operands: float32 summation order only (split-K
    # partitions differ); bound 32 partial sums * 2^-24 * |y| <= 5 ~ 1e-5; not yet measured on a GPU
    ("plans", torch.float32): (2e-5, 1e-5),
}
DTYPES = [torch.float32, torch.bfloat16]


def block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Test-local block quantiser (the checkpoint format): per block scale = absmax / 448."""
    bn, bk = block
    n, k = w.shape
    scales = torch.zeros(-(-n // bn), -(-k // bk))
    q = torch.zeros(n, k)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float().cpu()
            scales[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = tile / scales[i, j]
    return q.to(E4M3).to(w.device), scales.to(w.device)


def act_qdq(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Test-local per-token-group quantise-dequantise (scale = absmax / 448, round to nearest e4m3)."""
    k = x.shape[-1]
    groups = -(-k // group)
    xp = torch.nn.functional.pad(x.float(), (0, groups * group - k)).reshape(*x.shape[:-1], groups, group)
    s = xp.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (xp / s).clamp(-448, 448).to(E4M3).float() * s
    return q.reshape(*x.shape[:-1], groups * group)[..., :k]


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_block_dequant_round_trip(impl, tol, device, block):
    dequant = impl("fp8_block_dequant", torch.float32)
    # rows of very different magnitude so that the per-block scales matter
    w = (
        randn(200, 300, seed=1, dtype=torch.float32, device=device)
        * torch.logspace(-4, 1, 200, device=device)[:, None]
    )
    w_fp8, scale_inv = block_quantize(w, block)
    back = dequant(w_fp8, scale_inv, block, torch.float32)
    assert back.shape == w.shape and back.dtype == torch.float32
    blk_scale = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:200, :300]
    assert_close(
        back / blk_scale, w / blk_scale, tol("roundtrip", torch.float32), f"fp8 block round trip {block}"
    )
    # Exactness against a loop over the blocks, in float32 and bf16.
    bn, bk = block
    for dtype in DTYPES:
        out = dequant(w_fp8, scale_inv, block, dtype=dtype)
        assert out.dtype == dtype
        expected = torch.empty(200, 300, dtype=torch.float64)
        for i in range(scale_inv.shape[0]):
            for j in range(scale_inv.shape[1]):
                sl = (slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk))
                expected[sl] = w_fp8[sl].double().cpu() * scale_inv[i, j].double().cpu()
        assert_close(out, expected, tol("dequant_exact", dtype), f"fp8 block dequant vs block loop {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [128, 300])
def test_act_quant(impl, tol, device, dtype, k):
    quant = impl("fp8_act_quant", dtype)
    x = randn(65, k, seed=2, dtype=dtype, device=device) * torch.logspace(-3, 0, 65, device=device)[
        :, None
    ].to(dtype)
    x[3] = 0  # an all-zero token
    x_fp8, scales = quant(x, 128)
    groups = -(-k // 128)
    assert x_fp8.dtype == E4M3 and x_fp8.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (65, groups)
    expanded = scales.repeat_interleave(128, 1)[:, :k]
    back = x_fp8.float() * expanded
    assert_close(back, x.float(), tol("act_roundtrip", dtype), f"fp8 act quant round trip {dtype} K={k}")
    assert torch.equal(back[3], torch.zeros(k, device=device)), "zero token stays zero"
    # every non-zero group's absmax maps to +-448 exactly
    amax = (
        torch.nn.functional.pad(x_fp8.float().abs(), (0, groups * 128 - k)).reshape(65, groups, 128).amax(-1)
    )
    nonzero = torch.ones(65, dtype=torch.bool)
    nonzero[3] = False
    assert torch.all(amax[nonzero.to(device)] == 448.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(impl, tol, device, dtype, with_bias):
    linear, dequant = impl("fp8_linear", dtype), impl("fp8_block_dequant", dtype)
    n, k = 200, 300
    w_fp8, scale_inv = block_quantize(
        randn(n, k, seed=3, dtype=torch.float32, device=device) * 0.05, (128, 128)
    )
    x = randn(63, k, seed=4, dtype=dtype, device=device)
    bias = randn(n, seed=5, dtype=dtype, device=device) if with_bias else None
    y = linear(x, w_fp8, scale_inv, (128, 128), bias)
    assert y.shape == (63, n) and y.dtype == dtype
    w64 = dequant(w_fp8, scale_inv, (128, 128), torch.float32).double().cpu()
    x64 = act_qdq(x).double().cpu()  # W8A8: the activations are quantised per token-group of 128
    expected = x64 @ w64.t() + (bias.double().cpu() if with_bias else 0)
    assert_close(y, expected, tol("linear", dtype), f"fp8_linear {dtype} bias={with_bias}")


def test_kv_quant_round_trip(impl, tol, device):
    quant, dequant = impl("fp8_kv_quant", torch.float32), impl("fp8_kv_dequant", torch.float32)
    x = randn(7, 2, 64, seed=6, dtype=torch.float32, device=device)
    scale = torch.tensor([0.05], device=device)
    q = quant(x, scale)
    assert q.dtype == E4M3 and q.shape == x.shape
    for dtype in DTYPES:
        back = dequant(q, 0.05, dtype)
        assert back.dtype == dtype
    back = dequant(q, scale, torch.float32)
    assert_close(back, x, tol("kv", torch.float32), "fp8 kv round trip")
    big = quant(torch.tensor([1e6, -1e6], device=device), 1.0)
    assert big.float().tolist() == [448.0, -448.0], "out-of-range values saturate at +-448"


def test_bad_inputs(impl, device):
    dequant, linear = impl("fp8_block_dequant", torch.float32), impl("fp8_linear", torch.float32)
    quant, kvq = impl("fp8_act_quant", torch.float32), impl("fp8_kv_quant", torch.float32)
    w = torch.zeros(200, 300, device=device).to(E4M3)
    s = torch.ones(2, 3, device=device)
    with pytest.raises(
        ValueError, match=r"scale_inv must have shape \[ceil\(N/bn\)=2, ceil\(K/bk\)=3\], got \(2, 2\)"
    ):
        dequant(w, s[:, :2], (128, 128), torch.float32)
    with pytest.raises(ValueError, match="w must have dtype float8_e4m3fn"):
        dequant(w.float(), s, (128, 128), torch.float32)
    with pytest.raises(ValueError, match="block must be a pair of positive ints"):
        dequant(w, s, (128,), torch.float32)
    with pytest.raises(ValueError, match="dtype must be one of"):
        dequant(w, s, (128, 128), torch.int8)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., K=300\]"):
        linear(torch.randn(4, 299, device=device), w, s)
    with pytest.raises(ValueError, match=r"bias must have shape \[N=200\]"):
        linear(torch.randn(4, 300, device=device), w, s, (128, 128), torch.zeros(300, device=device))
    x = torch.randn(4, 300, device=device)
    with pytest.raises(ValueError, match=r"tickets must have dtype int32"):
        linear(x, w, s, (128, 128), None, tickets=torch.zeros(13, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"tickets holds 12 counters, needs >= 13 \(N / 16\)"):
        linear(x, w, s, (128, 128), None, tickets=torch.zeros(12, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="group must be a positive int"):
        quant(torch.randn(4, 300, device=device), 0)
    with pytest.raises(ValueError, match="scale must be a positive number"):
        kvq(torch.randn(4, device=device), -1.0)


# --- Triton fp8_linear launch plans -------------------------------------------------------------------
# (N, K) of the Qwen3-Next-80B-A3B FP8 checkpoint's block-quantised dense projections
# (tests/data/qwen3-next-80b-a3b-instruct-fp8.json: hidden 2048, 16 + 16 key / 32 value GDN heads of 128,
# 16 query / 2 KV attention heads of 256 with an output gate, shared expert intermediate 512)
SHAPES_80B = {
    "gdn in_proj_qkvz": (12288, 2048),
    "gdn out_proj / attn o_proj": (2048, 4096),
    "attn q_proj (query + gate)": (8192, 2048),
    "attn k_proj / v_proj": (512, 2048),
    "shared expert gate_up": (1024, 2048),
    "shared expert down": (2048, 512),
}
DECODE_MS = [1, 2, 8, 16, 64]
H200_SMS = 132


def _fp8_triton():
    """The Triton FP8 module (its plans are pure Python, but the module needs Triton: atom-kernels does not
    depend on it, so an install without Triton skips these tests)."""
    pytest.importorskip("triton", reason="atom-kernels' Triton backend is optional: triton is not installed")
    from atom_kernels.ops.fp8 import triton as fp8_triton

    return fp8_triton


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("shape", list(SHAPES_80B.values()), ids=list(SHAPES_80B))
def test_linear_plan_decode(m, shape):
    n, k = shape
    fp8_triton = _fp8_triton()
    assert fp8_triton.plan(m, n, k, 128, H200_SMS)["ONE_LAUNCH"] is (m <= fp8_triton.ONE_LAUNCH_MAX_M)
    cfg = fp8_triton.plan(m, n, k, 128, H200_SMS, {"ONE_LAUNCH": True})
    assert cfg["ONE_LAUNCH"] is True
    rows = cfg["ROWS"]
    assert rows >= max(2, m) and rows & (rows - 1) == 0 and rows < 2 * max(2, m)
    assert cfg["BLOCK_N"] in (16, 32, 64) and (m <= 16 or cfg["BLOCK_N"] >= 64)
    assert cfg["SWAP_AB"] is (rows <= 8) and (not cfg["SWAP_AB"] or cfg["BLOCK_N"] >= 32)
    tiles = -(-n // cfg["BLOCK_N"])
    assert 1 <= cfg["SPLIT_K"] <= max(1, (k // 128) // 4)
    if cfg["SWAP_AB"]:  # the swept M = 2 plan: up to 4 splits, 64-column tiles only for wide N
        assert cfg["SPLIT_K"] <= 4 and (cfg["BLOCK_N"] == 64) is (n >= 32 * H200_SMS)
    elif cfg["SPLIT_K"] > 1:  # split only where the column tiles leave SMs idle
        assert tiles * cfg["SPLIT_K"] <= H200_SMS


def test_linear_plan_selection():
    plan = _fp8_triton().plan
    # qkvz at M = 1: 192 column tiles of 64, 4 splits of 4 groups (the H200 sweep's best at M = 2)
    assert plan(1, 12288, 2048, 128, H200_SMS) == dict(
        ONE_LAUNCH=True, ROWS=2, BLOCK_N=64, SPLIT_K=4, SWAP_AB=True, num_warps=2, num_stages=4
    )
    assert plan(2, 2048, 4096, 128, H200_SMS)["BLOCK_N"] == 32  # out_proj: narrow tiles, 4 splits
    assert (
        plan(16, 12288, 2048, 128, H200_SMS, {"ONE_LAUNCH": True})["SWAP_AB"] is False
    )  # 16+ rows: mma tiles
    # k/v at M = 1: 16 tiles of 32 leave SMs idle -> 4 splits of 4 groups
    assert plan(1, 512, 2048, 128, H200_SMS)["SPLIT_K"] == 4
    # prefill keeps the three-launch plans
    big = plan(4096, 12288, 2048, 128, H200_SMS)
    assert big["ONE_LAUNCH"] is False and (big["BLOCK_M"], big["BLOCK_N"], big["num_warps"]) == (128, 128, 8)
    mid = plan(256, 2048, 4096, 128, H200_SMS)
    assert mid["ONE_LAUNCH"] is False and mid["BLOCK_M"] == 64
    # the three-launch decode plan on request, and for scale blocks wider than 256 channels
    three = plan(8, 12288, 2048, 128, H200_SMS, {"ONE_LAUNCH": False})
    assert three["ONE_LAUNCH"] is False and three["BLOCK_M"] == 16 and three["BLOCK_K"] == 128
    assert plan(8, 12288, 2048, 512, H200_SMS)["ONE_LAUNCH"] is False
    # overrides replace single keys
    cfg = plan(2, 12288, 2048, 128, H200_SMS, {"BLOCK_N": 64, "num_stages": 6})
    assert (cfg["ONE_LAUNCH"], cfg["ROWS"], cfg["BLOCK_N"], cfg["num_stages"]) == (True, 2, 64, 6)


def test_linear_decode_rows_checked():
    _fp8_triton()
    from atom_kernels.ops.fp8 import triton_decode as fp8_decode

    x, w, s = torch.zeros(3, 256), torch.zeros(64, 256).to(E4M3), torch.ones(1, 2)
    cfg = dict(ONE_LAUNCH=True, ROWS=2, BLOCK_N=32, SPLIT_K=1, SWAP_AB=False, num_warps=4, num_stages=4)
    with pytest.raises(ValueError, match=r"ROWS=2 must be a power of two >= M=3"):
        fp8_decode.launch_decode(x, w, s, (128, 128), None, cfg)


def _sm90_compiler():
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
    return ASTSource, GPUTarget


@pytest.mark.parametrize(
    "rows, block_n, split, even_k, bias, swap, one",
    [
        (2, 32, False, True, False, True, ()),
        (4, 16, True, False, True, False, ()),
        (8, 64, True, False, True, True, ()),
        (64, 64, True, True, False, False, ()),
        (2, 32, True, True, True, True, ("N",)),
        (16, 16, True, False, False, False, ("M", "N")),
    ],
)
def test_linear_decode_kernel_compiles_for_sm90(rows, block_n, split, even_k, bias, swap, one):
    """The one-launch kernel through Triton's whole NVIDIA pipeline (TTIR -> cubin) for sm_90, no GPU
    needed: catches type and layout errors that only a GPU run would otherwise show. ``one``: int
    arguments equal to 1, which Triton passes as constexprs (N = 1 or M = 1 with split-K). The 2-row cases
    are compiled with ``PDL`` (programmatic dependent launch): their PTX must hold ``griddepcontrol``."""
    ast_source, gpu_target = _sm90_compiler()
    _fp8_triton()
    from atom_kernels.ops.fp8 import triton_decode as fp8_decode

    sig = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", y_ptr="*bf16", bias_ptr="*bf16",
               part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", K="i32", stride_xm="i32",
               stride_wn="i32", stride_wsn="i32", stride_ym="i32", GROUPS_PER_SPLIT="i32",
               SPLIT_K="i32", z_ptr="*bf16", nw_ptr="*bf16", stride_zm="i32", res_ptr="*bf16",
               h_ptr="*bf16", yn_ptr="*bf16", stride_rm="i32", stride_hm="i32", stride_ynm="i32")  # fmt: skip
    consts = dict(EPS=1e-10, FMAX=448.0, BN_Q=128, GROUP=128, ROWS=rows, BLOCK_N=block_n, SWAP_AB=swap,
                  EVEN_K=even_k, SPLIT=split, HAS_BIAS=bias, PDL=rows == 2, GATED_NORM=False, NORM_EPS=0.0,
                  RMS_NORM=False, HAS_RES=False, SS_BLOCK=128, **dict.fromkeys(one, 1))  # fmt: skip
    src = ast_source(
        fp8_decode._fp8_linear_decode_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts
    )
    import triton

    try:
        kernel = triton.compile(
            src, target=gpu_target("cuda", 90, 32), options=dict(num_warps=4, num_stages=4)
        )
    except (RuntimeError, FileNotFoundError) as exc:
        if "ptxas" not in str(exc):
            raise
        pytest.skip(f"no usable ptxas for sm_90 here: {exc}")
    assert kernel.asm["cubin"], "no cubin"
    assert ("atom.global.gpu.acq_rel.add" in kernel.asm["ptx"]) == split, "split-K ticket"
    assert ("griddepcontrol.wait" in kernel.asm["ptx"]) == (rows == 2), "PDL wait"


def _gpu(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("the Triton FP8 kernels run on a GPU only (Triton's CPU interpreter flushes e4m3 "
                    "subnormals and does not saturate): run with --device cuda")  # fmt: skip


@functools.cache
def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` e4m3 weight with 128 x 128 block scales (CPU; cached across the M cases)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    bn = -(-n // 128)
    bk = -(-k // 128)
    t = torch.nn.functional.pad(w, (0, bk * 128 - k, 0, bn * 128 - n)).reshape(bn, 128, bk, 128)
    s = t.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
    q = (t / s[:, None, :, None]).reshape(bn * 128, bk * 128)[:n, :k].to(E4M3)
    return q, s


def _linear_case(device, n, k, m, dtype, bias: bool, seed: int = 11):
    w_fp8, scale_inv = (t.to(device) for t in _weight(n, k, seed))
    x = randn(m, k, seed=seed + 1, dtype=dtype, device=device)
    b = randn(n, seed=seed + 2, dtype=dtype, device=device) if bias else None
    return x, w_fp8, scale_inv, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", DECODE_MS)
@pytest.mark.parametrize(
    "n, k, bias",
    [(*s, False) for s in SHAPES_80B.values()] + [(200, 300, True), (1000, 1100, True)],
    ids=list(SHAPES_80B) + ["odd 200x300 bias", "odd 1000x1100 bias"],
)
def test_linear_decode_plan_vs_reference(device, n, k, bias, m, dtype):
    """The one-launch plan (its default tiles) at the 80B shapes and odd ones, against the float64
    reference fed the same quantisation (``act_qdq`` and the dequantised weight)."""
    _gpu(device)
    fp8_triton = _fp8_triton()
    x, w_fp8, scale_inv, b = _linear_case(device, n, k, m, dtype, bias)
    y = fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, config={"ONE_LAUNCH": True})
    assert y.shape == (m, n) and y.dtype == dtype
    w64 = w_fp8.double() * scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    expected = act_qdq(x).double() @ w64.t() + (b.double() if bias else 0)
    key = ("linear", dtype, "triton") if ("linear", dtype, "triton") in TOL else ("linear", dtype)
    assert_close(y, expected, TOL[key], f"fp8_linear one launch {n}x{k} M={m} {dtype} bias={bias}")


def _matched(block_n: int, split: int) -> tuple[dict, dict]:
    """The two plans with the same tiles (16-row tensor-core tiles, one 128-channel group per K tile,
    the same split-K partition): their outputs must agree bit for bit."""
    one = dict(ONE_LAUNCH=True, ROWS=16, BLOCK_N=block_n, SPLIT_K=split, SWAP_AB=False, num_warps=4,
               num_stages=4)  # fmt: skip
    three = dict(ONE_LAUNCH=False, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1, SPLIT_K=split,
                 num_warps=4, num_stages=4)  # fmt: skip
    return one, three


@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize(
    "n, k, bias, block_n, split",
    [(2048, 4096, False, 32, 1), (512, 2048, True, 16, 4), (1000, 1100, True, 32, 3)],
    ids=["out_proj", "kv split-K bias", "odd split-K bias"],
)
def test_linear_one_launch_bit_equal_three_launch(device, n, k, bias, block_n, split, m):
    """Same tiles and split-K partition in both plans: the in-kernel quantisation must give the operands
    and scales of ``_act_quant_kernel`` bit for bit, so the outputs are equal (float32, no tolerance)."""
    _gpu(device)
    fp8_triton = _fp8_triton()
    x, w_fp8, scale_inv, b = _linear_case(device, n, k, m, torch.float32, bias)
    x[0, :128] = 0.0  # an all-zero group (scale floor) and zeros that skip the division
    x[-1, 5] = 3e4  # one large value: the rest of its group quantises near zero, subnormals included
    one, three = _matched(block_n, split)
    y1 = fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, config=one)
    y3 = fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, config=three)
    diff = (y1 - y3).abs().max().item()
    assert torch.equal(y1, y3), f"one launch != three launches (max |diff| {diff:.3e}) {n}x{k} M={m}"


@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("k, bias", [(2048, False), (1100, True)], ids=["K=2048", "odd K=1100 bias"])
def test_linear_one_launch_single_column(device, k, bias, m):
    """N == 1 (Triton passes an int argument equal to 1 as a constexpr) through the one-launch plan with
    split-K (its default at N = 1): against the float64 reference in float32 and bf16, and bit-equal to
    the three-launch plan with matched tiles and split."""
    _gpu(device)
    fp8_triton = _fp8_triton()
    n = 1
    assert fp8_triton.plan(m, n, k, 128, H200_SMS, {"ONE_LAUNCH": True})["SPLIT_K"] > 1
    for dtype in DTYPES:
        x, w_fp8, scale_inv, b = _linear_case(device, n, k, m, dtype, bias)
        y = fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, config={"ONE_LAUNCH": True})
        assert y.shape == (m, n) and y.dtype == dtype
        w64 = w_fp8.double() * scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        expected = act_qdq(x).double() @ w64.t() + (b.double() if bias else 0)
        key = ("linear", dtype, "triton") if ("linear", dtype, "triton") in TOL else ("linear", dtype)
        assert_close(y, expected, TOL[key], f"fp8_linear one launch N=1 K={k} M={m} {dtype} bias={bias}")
    x, w_fp8, scale_inv, b = _linear_case(device, n, k, m, torch.float32, bias)
    one, three = _matched(16, 4)
    y1 = fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, config=one)
    y3 = fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, config=three)
    assert torch.equal(y1, y3), f"one launch != three launches at N=1 K={k} M={m}"


@pytest.mark.parametrize("m", DECODE_MS)
@pytest.mark.parametrize("shape", list(SHAPES_80B.values()), ids=list(SHAPES_80B))
def test_linear_default_plans_agree(device, shape, m):
    """The one-launch plan against the three-launch plan (default tiles each) at the 80B shapes (float32):
    the same quantised operands, so only the float32 summation order differs; repeated calls are bit-equal
    (the split-K reduction order is fixed)."""
    _gpu(device)
    fp8_triton = _fp8_triton()
    n, k = shape
    x, w_fp8, scale_inv, _ = _linear_case(device, n, k, m, torch.float32, False)
    one = {"ONE_LAUNCH": True}
    y1 = fp8_triton.fp8_linear(x, w_fp8, scale_inv, config=one)
    y3 = fp8_triton.fp8_linear(x, w_fp8, scale_inv, config={"ONE_LAUNCH": False})
    assert_close(y1, y3, TOL[("plans", torch.float32)], f"one launch vs three launches {n}x{k} M={m}")
    assert torch.equal(fp8_triton.fp8_linear(x, w_fp8, scale_inv, config=one), y1), "repeated call differs"


def test_linear_decode_split_k_in_cuda_graph(device):
    """Split-K one-launch plan captured in a CUDA graph: replays give the eager result (tickets and
    partials are per call; the last program of each tile resets its ticket)."""
    _gpu(device)
    fp8_triton = _fp8_triton()
    x, w_fp8, scale_inv, b = _linear_case(device, 512, 2048, 2, torch.bfloat16, True)
    cfg = dict(ONE_LAUNCH=True, ROWS=2, BLOCK_N=16, SPLIT_K=4, SWAP_AB=True, num_warps=4, num_stages=4)
    eager = fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, config=cfg)
    _assert_replays_equal(
        lambda: fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, config=cfg), eager
    )


def _assert_replays_equal(call, expected: torch.Tensor, replays: int = 3) -> None:
    """``call()`` captured in a CUDA graph: every replay (output zeroed first) gives ``expected`` exactly."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(replays):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected), "graph replay differs from the eager call"


@pytest.mark.parametrize("m", [1, 2])
def test_linear_decode_caller_tickets(device, m):
    """The caller's counters (``tickets``) give the result of per-call counters, bit for bit, in eager calls
    and graph replays, and are left zero; a plan with more column tiles than counters is refused."""
    _gpu(device)
    fp8_triton = _fp8_triton()
    x, w_fp8, scale_inv, b = _linear_case(device, 512, 2048, m, torch.bfloat16, True)
    cfg = dict(ONE_LAUNCH=True, ROWS=2, BLOCK_N=16, SPLIT_K=4, SWAP_AB=True, num_warps=2, num_stages=4)
    tickets = torch.zeros(512 // 16, dtype=torch.int32, device=device)
    fresh = fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, config=cfg)
    own = fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, tickets=tickets, config=cfg)
    assert torch.equal(own, fresh), "caller's tickets change the result"
    assert int(tickets.abs().sum()) == 0, f"tickets not left zero: {tickets.tolist()}"
    _assert_replays_equal(
        lambda: fp8_triton.fp8_linear(x, w_fp8, scale_inv, (128, 128), b, tickets=tickets, config=cfg), fresh
    )
    assert int(tickets.abs().sum()) == 0, f"tickets not left zero after replays: {tickets.tolist()}"
    with pytest.raises(ValueError, match=r"tickets holds 32 counters .* needs 64 \(BLOCK_N=8\)"):
        fp8_triton.fp8_linear(
            x, w_fp8, scale_inv, (128, 128), b, tickets=tickets, config={**cfg, "BLOCK_N": 8}
        )
