"""FP8 e4m3: block dequant round trip, activation quant, block-scaled linear, KV quant."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="group must be a positive int"):
        quant(torch.randn(4, 300, device=device), 0)
    with pytest.raises(ValueError, match="scale must be a positive number"):
        kvq(torch.randn(4, device=device), -1.0)
