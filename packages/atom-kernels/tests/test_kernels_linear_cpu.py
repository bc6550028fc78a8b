"""The cpu backend's ``linear`` on a weight prepared once (``pack_linear_weight``). oneDNN's packed weight:
bit-equal to ``F.linear`` (the reference) in bf16, or within the one-rounding bound where oneDNN's kernel sums
in another order, at every row count, bias or not, leading dims, strided and empty inputs, eager and compiled (Dynamo traces ``atom_kernels::linear_packed`` as one call). The float32
copy (CPUs where oneDNN does not pack bf16): at every row count the float32 product of the widened tokens
rounded once (within the bound of one float32 accumulation and one bf16 rounding of the exact product),
eager and compiled. Which weights are prepared, and how."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_kernels import registry
from atom_kernels.ops.linear import PACKED_WEIGHT_BACKENDS, pack_linear_weight
from atom_kernels.ops.linear import cpu as linear_cpu
from atom_kernels.ops.linear.cpu import PACK_MIN_ROWS, packing_supported
from atom_kernels.testing import randn

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(
    not packing_supported(torch.bfloat16),
    reason="oneDNN does not pack bf16 linear weights on this CPU (needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)",
)


TOL = {
    # the float32 form (and a packed product that is not F.linear's bit for bit) against the exact (float64)
    # product: at most this fraction of the bound of one float32 accumulation and one bf16 rounding
    # (float32_form_excess); measured over every case of test_float32_form_is_float32_sums_rounded_once:
    # 0.98 (the bf16 rounding's half ulp dominates); the packed product's excess is not measured yet
    "float32_form_bound_fraction": 1.0,
}


def float32_form_excess(y, x, w, b) -> float:
    """The largest ``|y - exact|`` over its bound ``ulp_bf16(|exact|) / 2 + K * eps32 * (|x| @ |w|.T + |b|)``
    (one bf16 rounding of a float32 dot product of ``K`` terms), ``exact`` the float64 product."""
    x64, w64 = x.reshape(-1, x.shape[-1]).double(), w.double()
    b64 = None if b is None else b.double()
    exact = F.linear(x64, w64, b64)
    scale = F.linear(x64.abs(), w64.abs(), None if b64 is None else b64.abs())
    mag = exact.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    half_ulp = torch.exp2(torch.floor(torch.log2(mag)) - 8)
    bound = half_ulp + x.shape[-1] * torch.finfo(torch.float32).eps * scale
    return ((y.reshape(exact.shape).double() - exact).abs() / bound).max().item()


def cpu_linear():
    return registry.resolve("linear", CPU, torch.bfloat16, "cpu").fn


def weights(n: int, k: int, bias: bool, seed: int = 0):
    w = randn(n, k, seed=seed, dtype=torch.bfloat16, device=CPU, scale=k**-0.5)
    b = randn(n, seed=seed + 1, dtype=torch.bfloat16, device=CPU) if bias else None
    return w, b


def test_cpu_backend_takes_packed_weights():
    assert "cpu" in PACKED_WEIGHT_BACKENDS
    assert registry.resolve("linear", CPU, torch.bfloat16).backend == "cpu"


@needs_packing
@pytest.mark.parametrize("m", [1, 2, 16, 33, 256, 512])
@pytest.mark.parametrize("n,k", [(16, 256), (256, 512), (1536, 256), (4096, 256), (512, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_bit_equal(m, n, k, bias):
    """bf16: the packed product is ``F.linear``'s bit for bit, or, where oneDNN's packed kernel sums in
    another order than ``F.linear``'s, within the bound of one float32 accumulation and one bf16 rounding of
    the exact product (bit-equal in every case on the AMX Xeon; not bit-equal at K = 2048 from 16 rows on
    the GPU machine's host CPU)."""
    w, b = weights(n, k, bias, seed=m + n + k)
    packed = pack_linear_weight(w)
    assert packed is not None and packed.is_mkldnn
    x = randn(m, k, seed=m, dtype=torch.bfloat16, device=CPU)
    y = cpu_linear()(x, w, b, packed=packed)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    if not torch.equal(y, F.linear(x, w, b)):
        excess = float32_form_excess(y, x, w, b)
        assert excess <= TOL["float32_form_bound_fraction"], f"max error {excess:.3f} of the rounding bound"


@needs_packing
def test_packed_linear_leading_dims_strided_and_empty():
    w, b = weights(256, 512, True)
    packed = pack_linear_weight(w)
    fn = cpu_linear()
    x3 = randn(3, 5, 512, seed=1, dtype=torch.bfloat16, device=CPU)
    assert torch.equal(fn(x3, w, b, packed=packed), F.linear(x3, w, b))
    wide = randn(7, 1024, seed=2, dtype=torch.bfloat16, device=CPU)
    strided = wide[:, ::2]  # a column-strided view
    assert torch.equal(fn(strided, w, b, packed=packed), F.linear(strided, w, b))
    rows = randn(9, 512, seed=3, dtype=torch.bfloat16, device=CPU)[::2]  # row-strided
    assert torch.equal(fn(rows, w, None, packed=packed), F.linear(rows, w))
    empty = fn(x3[:, :0], w, b, packed=packed)
    assert empty.shape == (3, 0, 256) and empty.dtype == torch.bfloat16


@needs_packing
def test_packed_linear_checks_its_inputs():
    w, b = weights(256, 512, True)
    packed = pack_linear_weight(w)
    x = randn(2, 512, seed=1, dtype=torch.bfloat16, device=CPU)
    with pytest.raises(ValueError, match="linear: weight must have dtype float32"):
        cpu_linear()(x.float(), w, b, packed=packed)
    with pytest.raises(ValueError, match=r"linear: bias must have shape \[N=256\]"):
        cpu_linear()(x, w, b[:4], packed=packed)


def test_which_weights_are_prepared():
    """bf16 2-D CPU weights of at least PACK_MIN_ROWS rows, packed by oneDNN where it packs bf16, else held in
    float32 (equal values); float32 (exact path: F.linear, MKL), fewer rows (F.linear's matrix-vector
    product is faster there) and other ranks are left to F.linear."""
    w = weights(PACK_MIN_ROWS, 64, False)[0]
    packed = pack_linear_weight(w)
    assert packed is not None
    if packing_supported(torch.bfloat16):
        assert packed.is_mkldnn
    else:
        assert packed.dtype == torch.float32 and torch.equal(packed, w.float()) and packed.is_contiguous()
    assert pack_linear_weight(weights(PACK_MIN_ROWS - 1, 64, False)[0]) is None
    assert pack_linear_weight(weights(64, 64, False)[0].float()) is None
    assert pack_linear_weight(weights(64, 64, False)[0][None]) is None


@pytest.mark.parametrize("m", [1, 2, 16, 33, 256])
@pytest.mark.parametrize("n,k", [(16, 256), (256, 512), (1536, 256), (4096, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_form_is_float32_sums_rounded_once(m, n, k, bias):
    """A float32 copy as ``packed`` (what CPUs without bf16 packing hold), on every CPU: bit-equal to the
    float32 product of the widened operands rounded once, and within the bound of that to the exact
    product."""
    w, b = weights(n, k, bias, seed=m + n + k)
    x = randn(m, k, seed=m, dtype=torch.bfloat16, device=CPU)
    y = cpu_linear()(x, w, b, packed=w.float())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    widened = F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
    assert torch.equal(y, widened)
    excess = float32_form_excess(y, x, w, b)
    assert excess <= TOL["float32_form_bound_fraction"], f"max error {excess:.3f} of the rounding bound"


def test_float32_form_leading_dims_strided_compiled_and_checked():
    """Leading dims and row-strided tokens; compiled (fullgraph, dynamic rows); a copy of another shape."""
    w, b = weights(256, 512, True)
    fn, w32 = cpu_linear(), w.float()
    x3 = randn(3, 6, 512, seed=1, dtype=torch.bfloat16, device=CPU)  # 18 rows: the float32 product
    strided = randn(17, 1024, seed=2, dtype=torch.bfloat16, device=CPU)[:, ::2]
    for x in (x3, strided):
        y = fn(x, w, b, packed=w32)
        assert y.shape == (*x.shape[:-1], 256)
        assert float32_form_excess(y, x, w, b) <= TOL["float32_form_bound_fraction"]
    assert fn(x3[:, :0], w, b, packed=w32).shape == (3, 0, 256)

    def f(x):
        return fn(x, w, b, packed=w32) * 2  # doubling is exact: compiled / 2 is the product inductor made

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for m in (16, 1, 3, 64):
        x = randn(m, 512, seed=m, dtype=torch.bfloat16, device=CPU)
        assert torch.equal(compiled(x), f(x))
    with pytest.raises(ValueError, match=r"linear: packed must be pack_linear_weight's copy of the \[N=256"):
        fn(x3, w, b, packed=w32[:128])


@needs_packing
@pytest.mark.parametrize("dynamic", [True, None])
def test_packed_linear_compiles(dynamic):
    """Under torch.compile (fullgraph) the op is one traced call: the compiled function's outputs are the
    eager ones at every row count it is called with."""
    w, b = weights(256, 512, True, seed=4)
    packed = pack_linear_weight(w)
    fn = cpu_linear()

    def f(x):
        return torch.relu(fn(x, w, b, packed=packed)) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for m in (16, 1, 3, 64):
        x = randn(m, 512, seed=m, dtype=torch.bfloat16, device=CPU)
        assert torch.equal(compiled(x), f(x))


@needs_packing
def test_packed_linear_op_fake_shape():
    """The op's fake implementation gives the real output's shape, dtype and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w, _ = weights(256, 512, False)
    packed = pack_linear_weight(w)
    x = randn(4, 3, 512, seed=1, dtype=torch.bfloat16, device=CPU)
    real = torch.ops.atom_kernels.linear_packed(x, packed, None, 256)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.atom_kernels.linear_packed(mode.from_tensor(x), packed, None, 256)
    assert fake.shape == real.shape and fake.dtype == real.dtype and fake.stride() == real.stride()


def test_cpu_without_bf16_packing_holds_float32(monkeypatch):
    """Where oneDNN refuses to pack bf16 (it raises on a CPU without AVX512-BW/VL/DQ or AVX-NE-CONVERT),
    nothing raises and the weights are held in float32: the linears run the float32 form."""

    class Refusing:
        @staticmethod
        def _reorder_linear_weight(w):
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(linear_cpu.torch.ops, "mkldnn", Refusing)
    packing_supported.cache_clear()
    try:
        assert not packing_supported(torch.bfloat16)
        w = weights(64, 64, False)[0]
        packed = pack_linear_weight(w)
        assert packed is not None and packed.dtype == torch.float32 and torch.equal(packed, w.float())
    finally:
        monkeypatch.undo()
        packing_supported.cache_clear()
