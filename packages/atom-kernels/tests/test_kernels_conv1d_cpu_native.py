"""The cpu backend's C conv update (``conv1d.cpu_native``) against its torch form and the reference.

Three verify steps on vLLM's layout (the state a ``[S, C, W]`` view of ``[S, W, C]`` storage) and on a
contiguous ``[S, C, W]`` pool, with a padding row, every acceptance count, row-strided tokens (a column
slice of a wider projection), bias or none, silu or no activation, more channels than one C block (256),
float32 or bf16, 1 or 2 threads.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from atom_kernels.ops.conv1d import cpu, cpu_native
from atom_kernels.ops.conv1d import reference as ref
from atom_kernels.testing import assert_close, randn

# (what, dtype) -> (atol, rtol); the same float32 expressions in the same order, no fused multiply-adds;
# silu's exponential is the pass's own polynomial e^x, torch's vectorised exp in the torch forms.
TOL = {
    ("out", torch.float32): (1e-6, 1e-6),  # measured 2.4e-07 (vs the torch form and the reference)
    ("out", torch.bfloat16): (1e-2, 1e-2),  # measured 0; allows one bf16 ulp where an expf rounding differs
    ("state", torch.float32): (0.0, 0.0),  # measured 0: the window is copied, not computed
    ("state", torch.bfloat16): (0.0, 0.0),  # measured 0
}

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler builds the conv")
CPU = torch.device("cpu")


def _run(form, args):
    if form == "reference":
        return ref.causal_conv1d_update(*args)
    if form == "torch":
        with mock.patch.object(cpu_native, "usable", lambda *_: False):
            return cpu.causal_conv1d_update(*args)
    with mock.patch.object(cpu_native, "conv_update", wraps=cpu_native.conv_update) as spy:
        out = cpu.causal_conv1d_update(*args)
    assert spy.call_count == 1, "the C conv did not run"
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["vllm", "contiguous"])
@pytest.mark.parametrize(
    ("channels", "q_len", "bias", "activation"),
    [(48, 2, True, "silu"), (300, 4, False, "silu"), (64, 1, True, None), (520, 3, False, None)],
)
def test_conv_update_native_equals_torch_and_reference(
    channels, q_len, bias, activation, layout, dtype, threads
):
    k_w, n, num_slots = 4, 5, 8
    width = k_w - 2 + q_len + 1  # room for the history of every acceptance count
    slots = torch.tensor([6, 1, -1, 3, 0], dtype=torch.int32)
    forms = ("native", "torch", "reference")
    storage = randn(num_slots, width, channels, seed=1, dtype=dtype, device=CPU)
    pool = storage.transpose(1, 2) if layout == "vllm" else storage.transpose(1, 2).contiguous()
    pools = {f: pool.clone() if layout == "contiguous" else storage.clone().transpose(1, 2) for f in forms}
    weight = randn(channels, k_w, seed=2, dtype=dtype, device=CPU, scale=0.5)
    b = randn(channels, seed=3, dtype=dtype, device=CPU) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(3):
            wide = randn(n, q_len, channels + 24, seed=10 + step, dtype=dtype, device=CPU, scale=2.0)
            x = wide[..., 5 : 5 + channels]  # row-strided, unit channel stride
            accepted = torch.tensor([1 + (step + i) % (width - k_w + 2) for i in range(n)], dtype=torch.int32)
            outs = {f: _run(f, (x, weight, b, pools[f], slots, accepted, activation)) for f in forms}
            for other in forms[1:]:
                what = f"step {step} vs {other}"
                assert_close(outs["native"], outs[other], TOL["out", dtype], f"{what}: out")
                assert_close(
                    pools["native"].float(), pools[other].float(), TOL["state", dtype], f"{what}: state"
                )
    finally:
        torch.set_num_threads(before)


def test_native_conv_taken_only_where_it_applies():
    x, w = torch.zeros(2, 2, 16), torch.zeros(16, 4)
    state = torch.zeros(3, 16, 5)
    assert cpu_native.usable(x, w, state, "silu") and cpu_native.usable(
        x.bfloat16(), w, state.bfloat16(), None
    )
    assert not cpu_native.usable(x.half(), w, state, "silu")
    assert not cpu_native.usable(x, w, state.half(), "silu")
    assert not cpu_native.usable(torch.zeros(2, 2, 32)[..., ::2], w, state, "silu")
    assert not cpu_native.usable(torch.zeros(2, cpu_native.MAX_COLUMNS, 16), w, state, "silu")


def test_native_silu_over_the_float_range():
    """The C conv's silu (its own vectorisable e^x) against torch's, on a tap that passes x through, over
    [-120, 120] (both exponent limits, where e^{-y} overflows to inf and underflows to 0)."""
    x = torch.cat([torch.linspace(-120.0, 120.0, 200_001), torch.tensor([0.0, -0.0, 88.38, -87.34, 1e-30])])
    channels = x.numel()
    weight = torch.zeros(channels, 4)
    weight[:, 3] = 1.0
    state = torch.zeros(1, channels, 3)
    out = cpu_native.conv_update(
        x.view(1, 1, -1), weight, None, state, torch.tensor([0], dtype=torch.int32), None, "silu"
    )
    # within 4e-07 of |silu(x)| element by element; largest abs error measured 1.2e-07 (|x| near 120)
    expected = F.silu(x)
    assert_close(out.view(-1), expected, (1e-30, 4e-7), "silu")
    assert torch.isfinite(out).all()
