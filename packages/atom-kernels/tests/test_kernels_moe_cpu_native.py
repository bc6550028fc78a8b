"""The cpu backend's C routed experts (``moe.cpu_native``) against the reference backend.

The bundled model's shapes (8 routed experts top-2 plus the shared expert as 2 pseudo-experts in every
token's row, H = 256, I = 64) and a larger one whose H and I are no multiple of the C pass's 16 / 32
lanes (48 experts top-6, H = 392, I = 72), T = 1 .. 300, float32 or bf16 tokens, weights in x.dtype or as
float32 copies held by their owner, slots held elsewhere (-1 ids), row-strided tokens, int32 ids, 1 or 2
threads. bf16 tokens with bf16 weights take AMX tiles at the bundled shapes where the CPU has them, and
AVX512-BF16 dot products at the larger one. The cpu backend's ``moe_experts`` must run the C pass (a spy
counts the calls).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from atom_kernels.ops.moe import cpu, cpu_native, reference
from atom_kernels.testing import assert_close, randn

# (dtype, weights) -> (atol, rtol) against the reference backend (the same float32 products up to the
# order of the sums; silu's e^x a polynomial of the C pass). Measured max abs error over
# test_moe_experts_native_matches_reference's cases in comments.
TOL = {
    ("f32", "x.dtype"): (1e-5, 1e-5),  # measured 3.1e-06 (|out| up to 4.5)
    ("f32", "float32"): (1e-5, 1e-5),  # measured 3.1e-06: the same operands
    # bf16: the activation and the result are rounded to bf16, so a last-bit difference of a float32 sum
    # can move either by one bf16 ulp
    ("bf16", "x.dtype"): (8e-3, 8e-3),  # measured 3.9e-03 (one ulp), 0.13% of the elements
    ("bf16", "float32"): (8e-3, 8e-3),  # measured 3.9e-03 (one ulp), 0.13% of the elements
}

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler builds the experts")
CPU = torch.device("cpu")
SHAPES = {
    "bundled": dict(num_experts=8, shared=2, hidden=256, inter=64, top_k=2),
    "larger": dict(num_experts=48, shared=0, hidden=392, inter=72, top_k=6),
}


def _case(shape: str, tokens: int, dtype: torch.dtype, seed: int = 0, stride_pad: int = 0):
    s = SHAPES[shape]
    rows = s["num_experts"] + s["shared"]
    hidden, inter = s["hidden"], s["inter"]
    wide = randn(tokens, hidden + stride_pad, seed=seed, dtype=dtype, device=CPU)
    x = wide[:, stride_pad // 2 : stride_pad // 2 + hidden]  # row stride hidden + stride_pad
    w13 = randn(rows, 2 * inter, hidden, seed=seed + 1, dtype=dtype, device=CPU, scale=hidden**-0.5)
    w2 = randn(rows, hidden, inter, seed=seed + 2, dtype=dtype, device=CPU, scale=inter**-0.5)
    cols = s["num_experts"] + (1 if s["shared"] else 0)
    logits = randn(tokens, cols, seed=seed + 3, dtype=dtype, device=CPU)
    weights, ids = reference.moe_router(logits, s["top_k"], True, num_shared=s["shared"])
    ids[::3, 1] = -1  # slots of experts held elsewhere contribute zero
    return x, weights, ids, w13, w2


def _native(x, weights, ids, w13, w2) -> torch.Tensor:
    """The C pass's result, through the cpu backend (checked: it ran)."""
    with mock.patch.object(cpu_native, "moe_experts", wraps=cpu_native.moe_experts) as spy:
        out = cpu.moe_experts(x, weights, ids, w13, w2)
    assert spy.call_count == 1, "the C experts did not run"
    return out


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@pytest.mark.parametrize("held", ["x.dtype", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("shape", "tokens"),
    [("bundled", t) for t in (1, 2, 3, 7, 16, 33, 64, 100, 300)] + [("larger", t) for t in (1, 5, 40, 257)],
)
def test_moe_experts_native_matches_reference(shape, tokens, dtype, held):
    x, weights, ids, w13, w2 = _case(shape, tokens, dtype, seed=tokens, stride_pad=24 if tokens % 2 else 0)
    expected = reference.moe_experts(x, weights, ids, w13, w2)
    if held == "float32":
        w13, w2 = w13.float(), w2.float()
    got = _native(x, weights, ids, w13, w2)
    assert got.dtype == dtype and got.shape == x.shape
    tag = "f32" if dtype == torch.float32 else "bf16"
    assert_close(got, expected, TOL[tag, held], f"{shape} T={tokens} {tag} weights {held}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_moe_experts_native_independent_of_threads_and_id_dtype(dtype):
    """Each token's slots are summed in one fixed order: 1 and 2 threads give the same bits; int32 ids
    the same as int64."""
    x, weights, ids, w13, w2 = _case("bundled", 77, dtype, seed=5)
    before = _threads(1)
    try:
        one = _native(x, weights, ids, w13, w2)
        torch.set_num_threads(2)
        two = _native(x, weights, ids, w13, w2)
        two_int32 = _native(x, weights, ids.int(), w13, w2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(one, two_int32)


def test_moe_experts_native_repeated_ids_and_unheld_rows():
    """A token routed twice to one expert (both slots count), a token with every slot held elsewhere
    (zero), and one expert that receives every token."""
    x, weights, ids, w13, w2 = _case("bundled", 9, torch.float32, seed=7)
    ids = ids.clone()
    ids[0, :2] = 4
    ids[1, :] = -1
    ids[2:, 0] = 6
    got = _native(x, weights, ids, w13, w2)
    assert_close(got, reference.moe_experts(x, weights, ids, w13, w2), TOL["f32", "x.dtype"], "repeats")
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_moe_experts_native_empty_and_bad_ids():
    x, weights, ids, w13, w2 = _case("bundled", 4, torch.float32, seed=9)
    assert _native(x[:0], weights[:0], ids[:0], w13, w2).shape == (0, 256)
    with pytest.raises(ValueError, match=r"ids must lie in \[-1, E=10\), got values in \[-1, 10\]"):
        cpu.moe_experts(x, weights, torch.where(ids == 9, 10, ids), w13, w2)
    with pytest.raises(ValueError, match=r"ids must lie in \[-1, E=10\), got values in \[-2, 9\]"):
        cpu.moe_experts(x, weights, torch.where(ids == -1, -2, ids), w13, w2)


def test_moe_experts_native_bf16_weights_close_to_held_float32():
    """bf16 weights (AVX512-BF16 dot products where the CPU has them) and their float32 copies give the
    same products up to the order of the sums."""
    x, weights, ids, w13, w2 = _case("bundled", 128, torch.bfloat16, seed=11)
    a = _native(x, weights, ids, w13, w2)
    b = _native(x, weights, ids, w13.float(), w2.float())
    assert_close(a, b, TOL["bf16", "x.dtype"], "bf16 weights vs float32 copies")
