"""The cpu backend's chunked GDN on a float32 pool (the C pass of ``cpu_native_prefill``) against the
reference's chunked form and against the backend's torch chunked form.

The conformance tests (test_kernels_gdn.py) run the cpu backend as it is, so on a machine with a C compiler
they check this pass against the oracles at their head dims; here: varlen batches (an empty sequence, a
one-token one, several chunks long), a padding row, initial states present and not, slots out of order,
a pool whose slots are strided, the head dim the pass specialises (128) and a generic one, GQA, and 1 or 2
threads, each call spied on so the test sees the pass ran.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from atom_kernels.ops.gated_delta_rule import cpu_chunked, cpu_native_prefill, reference
from atom_kernels.testing import assert_close, gated_delta_rule_loop, gdn_inputs, randn

# (what) -> (atol, rtol). The pass sums each row's dot products in 16 lanes and a pairwise tree and
# applies the decay to s . k after the sum; the reference and the torch form use matmuls: float32
# rounding of the sums only. States up to ~2, outputs up to ~1.
TOL = {
    "vs_reference": (2e-6, 1e-6),  # measured 2.3e-07 (outputs), 4.2e-07 (states), 1 and 2 threads
    "vs_torch_form": (2e-6, 1e-6),  # measured 2.3e-07 (outputs), 4.8e-07 (states), first call
    "bf16_out": (4e-3, 1e-2),  # measured 3.8e-06; one bf16 rounding of an |o| < 0.5 may flip (2e-3)
    # against the float64 token loop, bf16 tokens as vLLM hands them (|o| < 0.09, states < 1.2); outputs:
    # measured 2.4e-04 for the pass and the torch form alike, half a bf16 ulp at |o| < 0.125
    "bf16_vs_float64_out": (5e-4, 0.0),
    "bf16_vs_float64_state": (2e-6, 1e-6),  # measured 4.1e-07 (pass), 3.0e-07 (torch form)
}
BF16_MISROUNDED = 1e-3
"""Largest share of bf16 outputs that may differ from the float64 result rounded to bf16 (a float32 sum
next to a rounding boundary): measured 16 of 136192 for the pass, 39 for the torch form, 46 for the
reference."""

pytestmark = pytest.mark.skipif(cpu_native_prefill.load() is None, reason="no C compiler builds the pass")

CASES = {  # heads (Hk, Hv, Dk, Dv): lens, slots, has_initial_state
    "generic_dk": ((2, 4, 32, 16), [5, 0, 70, 1, 130], [6, 1, -1, 3, 0], [True, False, True, True, False]),
    "dk128_gqa": ((1, 2, 128, 24), [9, 65, 1], [2, 0, 4], [False, True, True]),
    "dk48_rows_odd": ((2, 2, 48, 7), [33, 2], [1, -1], [True, True]),
}


def _pool(slots: int, heads: tuple[int, int, int, int], strided: bool) -> torch.Tensor:
    _, hv, dk, dv = heads
    cpu = torch.device("cpu")
    if strided:  # slot states contiguous, slots 2 states apart (a view into a larger page)
        return randn(slots, 2, hv, dv, dk, seed=7, dtype=torch.float32, device=cpu, scale=0.3)[:, 1]
    return randn(slots, hv, dv, dk, seed=7, dtype=torch.float32, device=cpu, scale=0.3)


def _call(fn, case: str, pool: torch.Tensor, dtype: torch.dtype = torch.float32):
    heads, lens, slots, init = CASES[case]
    q, k, v, g, beta = gdn_inputs((sum(lens),), 11, dtype, torch.device("cpu"), heads)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots_t, init_t = torch.tensor(slots, dtype=torch.int32), torch.tensor(init)
    return fn(q, k, v, g, beta, cu, pool, slots_t, init_t, heads[2] ** -0.5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided_slots"])
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_native_matches_reference(case, strided, threads):
    """Outputs and the whole state pool (stored slots, untouched others) equal the reference's."""
    heads = CASES[case][0]
    pools = [_pool(8, heads, strided) for _ in range(2)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with mock.patch.object(
            cpu_native_prefill, "gdn_prefill", wraps=cpu_native_prefill.gdn_prefill
        ) as spy:
            out = _call(cpu_chunked.gated_delta_rule_chunked, case, pools[0])
        assert spy.call_count == 1, "the C pass did not run"
    finally:
        torch.set_num_threads(before)
    expected = _call(reference.gated_delta_rule_chunked, case, pools[1])
    assert_close(out, expected, TOL["vs_reference"], f"{case}: outputs")
    assert_close(pools[0], pools[1], TOL["vs_reference"], f"{case}: state pool")


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_native_matches_torch_form(case):
    """The pass and the backend's torch chunked form (the pass switched off) agree, then a second call
    continues from the states the first stored."""
    heads = CASES[case][0]
    pools = [_pool(8, heads, False) for _ in range(2)]
    for step in range(2):
        outs = []
        for form in range(2):
            off = mock.patch.object(cpu_native_prefill, "usable", lambda *_: False)
            spy = mock.patch.object(cpu_native_prefill, "gdn_prefill", wraps=cpu_native_prefill.gdn_prefill)
            with off if form else spy as patched:
                outs.append(_call(cpu_chunked.gated_delta_rule_chunked, case, pools[form]))
                assert form or patched.call_count == 1, "the C pass did not run"
        assert_close(outs[0], outs[1], TOL["vs_torch_form"], f"{case} step {step}: outputs")
        assert_close(pools[0], pools[1], TOL["vs_torch_form"], f"{case} step {step}: state pool")


def _prefill(q, k, v, g, beta, cu, pool, slots, init, scale):
    return cpu_native_prefill.gdn_prefill(q, k, v, g, beta, cu, pool, slots, init, scale, True)


def test_prefill_native_bf16_inputs():
    """bf16 q/k/v on a float32 pool: the chunked op hands them to the pass, which returns bf16 and matches
    the reference."""
    pools = [_pool(8, CASES["dk128_gqa"][0], False) for _ in range(2)]
    with mock.patch.object(cpu_native_prefill, "gdn_prefill", wraps=cpu_native_prefill.gdn_prefill) as spy:
        out = _call(cpu_chunked.gated_delta_rule_chunked, "dk128_gqa", pools[0], torch.bfloat16)
    assert spy.call_count == 1 and out.dtype == torch.bfloat16
    expected = _call(reference.gated_delta_rule_chunked, "dk128_gqa", pools[1], torch.bfloat16)
    assert_close(out, expected, TOL["bf16_out"], "bf16 outputs")
    assert_close(pools[0], pools[1], TOL["vs_reference"], "state pool")


def test_prefill_native_bf16_as_vllm_hands_them():
    """bf16 tokens in the form vLLM's prompt step hands them: q, k and v column views of one conv output
    ``[T, 2 Hk Dk + Hv Dv]``, float32 g and beta, int32 cu_seqlens, the bundled model's heads (2 key, 4
    value, 128 x 128), slots three apart in a float32 pool, full-chunk prompts next to a continued chunk, a
    one-token, an empty and a padding sequence. The pass's outputs and final states match the float64 token
    loop as closely as the torch chunked form's do."""
    hk, hv, dk, dv = 2, 4, 128, 128
    lens, slots, init = (
        [64, 64, 1, 0, 100, 37],
        [1, 4, 7, 10, -1, 16],
        [False, True, True, False, True, False],
    )
    q, k, v, g, beta = gdn_inputs((sum(lens),), 3, torch.bfloat16, torch.device("cpu"), (hk, hv, dk, dv))
    packed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    views = packed[:, : hk * dk].view(-1, hk, dk), packed[:, hk * dk : 2 * hk * dk].view(-1, hk, dk)
    views += (packed[:, 2 * hk * dk :].view(-1, hv, dv),)
    pool = randn(18, hv, dv, dk, seed=7, dtype=torch.float32, device=torch.device("cpu"), scale=0.05)
    offsets = [0, *torch.tensor(lens).cumsum(0).tolist()]
    want_o, want_states = [], {}
    for n, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        start = pool[slots[n]] if init[n] and slots[n] >= 0 else torch.zeros(hv, dv, dk)  # padding: zero
        o, states = gated_delta_rule_loop(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], start, dk**-0.5
        )
        want_o.append(o)
        if slots[n] >= 0:
            want_states[slots[n]] = states[-1] if states else start.double()
    want_o = torch.cat(want_o)
    args = (
        torch.tensor(offsets, dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int32),
        torch.tensor(init),
    )
    for what in ("pass", "torch form"):
        pool_after = pool.clone()
        off = mock.patch.object(cpu_native_prefill, "usable", lambda *_: False)
        spy = mock.patch.object(cpu_native_prefill, "gdn_prefill", wraps=cpu_native_prefill.gdn_prefill)
        with off if what == "torch form" else spy as patched:
            out = cpu_chunked.gated_delta_rule_chunked(
                *views, g, beta, args[0], pool_after, *args[1:], dk**-0.5
            )
            assert what != "pass" or patched.call_count == 1, "the C pass did not run"
        assert out.dtype == torch.bfloat16
        assert_close(out, want_o, TOL["bf16_vs_float64_out"], f"{what}: outputs")
        misrounded = (out != want_o.to(torch.bfloat16)).sum().item()
        assert misrounded <= BF16_MISROUNDED * out.numel(), f"{what}: {misrounded} misrounded outputs"
        for slot, state in want_states.items():
            assert_close(pool_after[slot], state, TOL["bf16_vs_float64_state"], f"{what}: state {slot}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_native_strided_tokens(dtype):
    """q, k and v as column slices of one projection output (token stride wider than a row, as the conv
    output is split): read in place (float32 / bf16) or converted (float16); same result as contiguous
    copies."""
    heads, lens, slots, init = CASES["dk128_gqa"]
    hk, hv, dk, dv = heads
    q, k, v, g, beta = gdn_inputs((sum(lens),), 11, dtype, torch.device("cpu"), heads)
    packed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    views = packed[:, : hk * dk].view(-1, hk, dk), packed[:, hk * dk : 2 * hk * dk].view(-1, hk, dk)
    views += (packed[:, 2 * hk * dk :].view(-1, hv, dv),)
    assert not views[0].is_contiguous()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    rest = (torch.tensor(slots, dtype=torch.int32), torch.tensor(init), dk**-0.5)
    pools = [_pool(8, heads, False) for _ in range(2)]
    outs = []
    for form, (qq, kk, vv) in enumerate([views, (q, k, v)]):
        outs.append(_prefill(qq, kk, vv, g, beta, cu, pools[form], *rest))
        assert outs[-1].dtype == dtype
    assert torch.equal(outs[0], outs[1]) and torch.equal(pools[0], pools[1])


def test_prefill_native_taken_only_where_it_applies():
    """The pass takes float32 pools with contiguous slot states and a head dim that is a multiple of 16 up
    to MAX_HEAD_DIM; anything else leaves the torch chunked form."""
    assert cpu_native_prefill.usable(torch.zeros(2, 2, 8, 128))
    assert cpu_native_prefill.usable(torch.zeros(2, 2, 8, cpu_native_prefill.MAX_HEAD_DIM))
    assert not cpu_native_prefill.usable(torch.zeros(2, 2, 8, cpu_native_prefill.MAX_HEAD_DIM + 16))
    assert not cpu_native_prefill.usable(torch.zeros(2, 2, 8, 40))
    assert not cpu_native_prefill.usable(torch.zeros(2, 2, 8, 128).bfloat16())
    assert not cpu_native_prefill.usable(torch.zeros(2, 2, 128, 8).transpose(-1, -2))
    assert not cpu_native_prefill.usable(torch.zeros(0, 2, 8, 128))
