"""``linear`` (``x @ weight.T + bias``) against a float64 oracle and against the reference backend
(``F.linear``) on the same device; the Triton GEMV's plan (GEMV or ``F.linear`` fallback), its tuning knobs,
strided and leading-dim inputs, bad inputs. The triton backend runs on a GPU, or on CPU under
``TRITON_INTERPRET=1`` (the GEMV multiplies elementwise, no ``tl.dot``, so bf16 runs there too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_kernels import registry
from atom_kernels.testing import assert_close, randn, row_strided

# (what, dtype) -> (atol, rtol). "linear": against the float64 oracle; "vs_reference": the backend against
# the reference backend (F.linear) on the same device. Measured max abs error in the comments, |y| < ~5
# (x ~ N(0, 1), weight ~ N(0, 1/K), bias ~ N(0, 1)). The GEMV accumulates in float32 and rounds once, like
# F.linear. Triton's CPU interpreter converts float32 -> bf16 by truncation (toward zero; 2047 of 2048
# outputs equal the truncated float64 result), so its bf16 error reaches one ulp where a GPU's
# round-to-nearest gives half an ulp: rtol 2^-7 (one bf16 ulp) covers both.
# H200 (--device cuda, ATOM_KERNELS_REPORT_ERRORS=1, every case): float32 max abs 4.3e-07 (7.2e-07 against the
# reference); bf16 max abs 1.5e-02, rel 3.4e-03 (1.6e-02 / 4.0e-03 against the reference: half an ulp).
TOL = {
    # measured 2.0e-06, rel 5.9e-07 (reference, CPU, and interpreter)
    ("linear", torch.float32): (2e-5, 1e-5),
    # measured 3.1e-02 at |y| ~ 5, rel 5.6e-03 (interpreter: truncation, one ulp) / 1.6e-02 (reference: half an ulp)
    ("linear", torch.bfloat16): (1e-3, 2**-7),
    # measured 9.5e-04, rel 2.5e-04 (reference and interpreter: half an fp16 ulp)
    ("linear", torch.float16): (1e-3, 2**-10),
    # measured 2.2e-06, rel 6.2e-07 (interpreter: another float32 summation order) / 0 (reference)
    ("vs_reference", torch.float32): (2e-5, 1e-5),
    # measured 3.1e-02, rel 6.9e-03 (interpreter: truncation against round-to-nearest, one ulp). On the H200
    # F.linear (cuBLAS) at M = 1, N = 100, K = 200 differed from the GEMV by 1.56e-02 at |y| < 4 where the
    # GEMV was within 7.7e-03 of float64 (and within one ulp): cuBLAS's own error at that shape, hence atol
    ("vs_reference", torch.bfloat16): (2e-2, 2**-7),
    # measured 0 (interpreter)
    ("vs_reference", torch.float16): (1e-3, 2**-10),
    # strided / leading-dim inputs against the contiguous call of the same backend: measured 4.8e-07
    # (reference: CPU F.linear takes another kernel for strided operands) / 0 (interpreter)
    ("strided", torch.float32): (1e-6, 1e-6),
    ("strided", torch.bfloat16): (1e-6, 2**-7),  # measured 0 (reference and interpreter)
}
DTYPES = [torch.float32, torch.bfloat16]


def case(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, bias: bool, seed: int = 0):
    x = randn(m, k, seed=seed, dtype=dtype, device=device)
    w = randn(n, k, seed=seed + 1, dtype=dtype, device=device, scale=k**-0.5)
    b = randn(n, seed=seed + 2, dtype=dtype, device=device) if bias else None
    return x, w, b


def oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double().cpu() @ w.double().cpu().T
    return y if b is None else y + b.double().cpu()


def reference(device: torch.device, dtype: torch.dtype):
    return registry.resolve("linear", device, dtype, "reference").fn


def triton_linear(device: torch.device, dtype: torch.dtype):
    """The triton backend's ``linear`` (with its keyword knobs), or skip where it cannot run."""
    try:
        return registry.resolve("linear", device, dtype, "triton").fn
    except registry.KernelBackendError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [64, 96, 1024, 2048])
@pytest.mark.parametrize("k", [256, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(impl, tol, device, dtype, m, n, k, bias):
    """Against the float64 oracle and the reference; with the triton backend M <= 2 and N <= 1024 run the
    GEMV, the other shapes its F.linear fallback."""
    fn = impl("linear", dtype)
    x, w, b = case(m, n, k, dtype, device, bias, seed=m + n + k)
    y = fn(x, w, b)
    assert y.dtype == dtype and y.shape == (m, n) and y.device == x.device
    what = f"linear {dtype} M={m} N={n} K={k} bias={bias}"
    assert_close(y, oracle(x, w, b), tol("linear", dtype), what)
    assert_close(y, reference(device, dtype)(x, w, b), tol("vs_reference", dtype), f"{what} vs reference")


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_fp16(impl, tol, device, m, bias):
    fn = impl("linear", torch.float16)
    x, w, b = case(m, 96, 256, torch.float16, device, bias, seed=7)
    y = fn(x, w, b)
    assert y.dtype == torch.float16
    assert_close(y, oracle(x, w, b), tol("linear", torch.float16), f"linear fp16 M={m}")
    ref = reference(device, torch.float16)(x, w, b)
    assert_close(y, ref, tol("vs_reference", torch.float16), f"linear fp16 M={m} vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_strides_and_leading_dims(impl, tol, device, dtype):
    """Row-strided x and weight (views of wider buffers whose other columns hold NaN), a strided bias,
    leading dims ``[2, 1, K]``, a weight without unit last stride (the triton backend's fallback) and zero
    rows: the values of the contiguous call (up to the summation order of the kernel taken)."""
    fn = impl("linear", dtype)
    x, w, b = case(2, 72, 160, dtype, device, True, seed=11)
    want = fn(x, w, b)
    b_strided = torch.stack([b, torch.full_like(b, float("nan"))], 1)[:, 0]
    got = fn(row_strided(x), row_strided(w), b_strided)
    assert_close(got, want, tol("strided", dtype), f"linear {dtype} strided inputs")
    got3 = fn(x.reshape(2, 1, -1), w, b)
    assert got3.shape == (2, 1, 72)
    assert_close(got3.reshape(2, 72), want, tol("strided", dtype), f"linear {dtype} leading dims")
    w_t = w.T.contiguous().T  # unit stride along N, not K
    assert_close(fn(x, w_t, b), oracle(x, w, b), tol("linear", dtype), f"linear {dtype} transposed weight")
    empty = fn(x[:0], w, b)
    assert empty.shape == (0, 72) and empty.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "block_n", "num_warps"), [(1, 1, 4), (2, 2, 2), (3, 4, 1), (4, 16, 8), (8, 1, 4), (8, 8, 2)]
)
def test_linear_triton_knobs(tol, device, dtype, m, block_n, num_warps):
    """The GEMV at every tile width the benchmark sweeps, at M up to 8 (``max_m`` raised), K = 200 (not a
    multiple of any BLOCK_K: the masked K tail) and N = 100 (a partial last column tile)."""
    fn = triton_linear(device, dtype)
    x, w, b = case(m, 100, 200, dtype, device, True, seed=m)
    y = fn(x, w, b, max_m=8, block_n=block_n, num_warps=num_warps)
    what = f"linear (triton) {dtype} M={m} block_n={block_n} num_warps={num_warps}"
    assert_close(y, oracle(x, w, b), tol("linear", dtype), what)
    assert_close(y, reference(device, dtype)(x, w, b), tol("vs_reference", dtype), f"{what} vs reference")


def test_linear_triton_fallback_is_f_linear(device):
    """``max_m=0`` (or ``max_n=0``) sends every call to F.linear: bit for bit the reference."""
    fn = triton_linear(device, torch.float32)
    x, w, b = case(2, 64, 256, torch.float32, device, True, seed=3)
    assert torch.equal(fn(x, w, b, max_m=0), F.linear(x, w, b))
    assert torch.equal(fn(x, w, None, max_n=0), F.linear(x, w))


def test_linear_plan():
    """GEMV where M <= 2 and N <= 1024, else None (F.linear); the accumulator stays within its register
    budget; the 80B model's ``in_proj_ba`` (N = 64, K = 2048) on an H200 (132 SMs): 64 programs of one
    weight row, the whole K in one step."""
    pytest.importorskip("triton")
    from atom_kernels.ops.linear.triton import ACC_PER_THREAD, GEMV_MAX_M, GEMV_MAX_N, plan

    assert plan(1, 64, 2048, 132) == dict(ROWS=1, BLOCK_N=1, BLOCK_K=2048, num_warps=4, num_stages=2)
    assert plan(2, 64, 2048, 132)["ROWS"] == 2
    assert plan(GEMV_MAX_M + 1, 64, 2048, 132) is None
    assert plan(1, GEMV_MAX_N + 1, 2048, 132) is None
    assert plan(0, 64, 2048, 132) is None and plan(1, 64, 0, 132) is None
    assert plan(8, 64, 2048, 132, max_m=8)["ROWS"] == 8
    assert plan(2, 1024, 2048, 132)["BLOCK_N"] == 4  # 256 programs
    for m in (1, 2, 3, 8):
        for n in (1, 64, 1000):
            for warps in (1, 4, 8):
                cfg = plan(m, n, 4096, 132, max_m=8, num_warps=warps)
                assert cfg["ROWS"] * cfg["BLOCK_N"] * cfg["BLOCK_K"] <= ACC_PER_THREAD * 32 * warps


def test_linear_bad_inputs(impl, device):
    fn = impl("linear", torch.float32)
    x, w, b = case(2, 8, 32, torch.float32, device, True)
    with pytest.raises(ValueError, match=r"linear: weight must have shape \[N, K=32\]"):
        fn(x, w[:, :16], b)
    with pytest.raises(ValueError, match="linear: weight must have dtype float32"):
        fn(x, w.to(torch.bfloat16), b)
    with pytest.raises(ValueError, match=r"linear: bias must have shape \[N=8\]"):
        fn(x, w, b[:4])
    with pytest.raises(ValueError, match="linear: x must have dtype"):
        fn(x.long(), w, b)
