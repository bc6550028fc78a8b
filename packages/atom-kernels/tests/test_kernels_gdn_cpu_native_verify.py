"""The cpu backend's one-call verify and decode steps (``cpu_native_verify``) against the same C pass with
their inputs prepared in torch, and against the reference ops.

Three verify steps with every acceptance count and a padding row, and two decode calls with a padding row,
on the layouts the plugin hands over: q / k / v as views of one conv output ``[N, Q, C]`` and the raw gates
as column slices of one projection (row-strided), bf16 or float32 tokens, fused gating (the gates computed
in C) or given gates, a head dim that is not a multiple of 16, GQA, with and without ``pending_pos``, 1 or
2 threads. Out-of-range slots and commit counts are caught by the C call before it writes anything.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from atom_kernels.ops.gated_delta_rule import cpu, cpu_native_verify, pending_width
from atom_kernels.ops.gated_delta_rule import reference as ref
from atom_kernels.testing import assert_close, gate_inputs, randn

# (what, compared with) -> (atol, rtol).
TOL = {
    # the same C state pass, inputs prepared in C vs in torch: the L2 norms' and the k . k / k . q dot
    # products' summation order, the C library's expf / log1pf (the gates, under fused gating) vs torch's
    # exp / softplus / sigmoid
    ("outputs", "torch_prep"): (2e-6, 1e-6),  # measured 4.5e-08 (verify), 7.5e-08 (decode); 1 and 2 threads
    # measured 2.4e-07 (verify state pool), 3.0e-07 (decode state pool), 1.9e-06 (pending pool: u up to ~30,
    # relative 1e-07, through an ulp of a C-computed gate)
    ("states", "torch_prep"): (4e-6, 1e-6),
    # against the reference ops (token by token in torch)
    ("outputs", "reference"): (2e-6, 1e-6),  # measured 4.5e-08 (verify), 6.0e-08 (decode)
    ("states", "reference"): (4e-6, 1e-6),  # measured 2.4e-07 / 3.0e-07 (state pools), 1.9e-06 (pending)
}

pytestmark = pytest.mark.skipif(cpu_native_verify._library() is None, reason="no C compiler builds the step")

CPU = torch.device("cpu")


def _tokens(n, q_len, heads, dtype, seed):
    """q, k, v as views of one ``[N, Q, C]`` conv output (row stride C), as ``split_qkv`` makes them."""
    hk, hv, dk, dv = heads
    x = randn(n, q_len, 2 * hk * dk + hv * dv, seed=seed, dtype=dtype, device=CPU)
    q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
    return q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))


def _run(form, args, kwargs, op="gated_delta_rule_verify", step="verify_step"):
    """``form``: "step" (spied on: it must run), "torch_prep" (the step switched off) or "reference"."""
    if form == "reference":
        return getattr(ref, op)(*args, **kwargs), None
    if form == "torch_prep":
        with mock.patch.object(cpu_native_verify, "usable", lambda *_: False):
            return getattr(cpu, op)(*args, **kwargs), None
    with mock.patch.object(cpu_native_verify, step, wraps=getattr(cpu_native_verify, step)) as spy:
        return getattr(cpu, op)(*args, **kwargs), spy


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gating", ["fused", "given"])
@pytest.mark.parametrize(
    ("heads", "q_len", "with_pos"),
    [
        ((2, 4, 32, 16), 1, True),
        ((2, 4, 32, 16), 2, True),
        ((2, 4, 32, 16), 4, False),
        ((1, 2, 40, 24), 3, True),
    ],
)
def test_verify_step_equals_torch_prep_and_reference(heads, q_len, with_pos, gating, dtype, threads):
    hk, hv, dk, dv = heads
    n, num_slots = 5, 8
    slots = torch.tensor([6, 1, -1, 3, 0], dtype=torch.int32)
    forms = ("step", "torch_prep", "reference")
    pool = randn(num_slots, hv, dv, dk, seed=3, dtype=torch.float32, device=CPU, scale=0.3)
    pools = {f: pool.clone() for f in forms}
    pendings = {f: torch.zeros(num_slots, q_len, pending_width(hk, dk, hv, dv)) for f in forms}
    positions = {f: torch.zeros(num_slots, 1, dtype=torch.int32) if with_pos else None for f in forms}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(3):
            q, k, v = _tokens(n, q_len, heads, dtype, 50 + step)
            a, b, A_log, dt_bias = gate_inputs((n, q_len), 60 + step, dtype, CPU, hv)
            A_log = A_log.float()
            kwargs = {"A_log": A_log, "dt_bias": dt_bias} if gating == "fused" else {}
            if gating == "given":
                a, b = ref._gate_values(a, b, A_log, dt_bias)
            commit = torch.tensor([(step + i) % (q_len + 1) for i in range(n)], dtype=torch.int32)
            commit = commit if step else torch.zeros_like(commit)
            outs = {}
            for f in forms:
                args = (q, k, v, a, b, pools[f], pendings[f], slots, commit, dk**-0.5)
                outs[f], spy = _run(f, args, {**kwargs, "pending_pos": positions[f]})
                assert spy is None or spy.call_count == 1, "the C step did not run"
            for other in forms[1:]:
                what = f"step {step} vs {other}"
                assert_close(outs["step"], outs[other], TOL["outputs", other], f"{what}: outputs")
                assert_close(pools["step"], pools[other], TOL["states", other], f"{what}: state pool")
                # the reference stashes the pending tokens as its own layout defines; compare real slots only
                real = slots[slots >= 0].long()
                assert_close(
                    pendings["step"][real], pendings[other][real], TOL["states", other], f"{what}: pending"
                )
                if with_pos:
                    assert torch.equal(positions["step"], positions[other]), f"{what}: pending_pos"
    finally:
        torch.set_num_threads(before)


def test_step_taken_only_where_it_applies():
    """float32 pool, float32 / bf16 tokens and gates with a unit last stride, int32 ``pending_pos``."""
    heads = (2, 4, 32, 16)
    q, k, v = _tokens(2, 2, heads, torch.bfloat16, 1)
    g = beta = torch.zeros(2, 2, 4)
    pool, pending = torch.zeros(4, 4, 16, 32), torch.zeros(4, 2, pending_width(2, 32, 4, 16))
    pos = torch.zeros(4, 1, dtype=torch.int32)
    assert cpu_native_verify.usable(q, k, v, g, beta, pool, pending, None, None, pos)
    assert not cpu_native_verify.usable(q, k, v, g, beta, pool.bfloat16(), pending, None, None, pos)
    assert not cpu_native_verify.usable(q.half(), k.half(), v, g, beta, pool, pending, None, None, pos)
    assert not cpu_native_verify.usable(q, k, v, g.half(), beta, pool, pending, None, None, pos)
    assert not cpu_native_verify.usable(q, k, v, g, beta, pool, pending, None, None, pos.long())
    strided = torch.zeros(2, 2, 8)[..., ::2]
    assert not cpu_native_verify.usable(q, k, v, strided, beta, pool, pending, None, None, pos)
    # decode (no pending pool); fused gating weights in float32 / bf16 only
    a_log = torch.zeros(4)
    assert cpu_native_verify.usable(q, k, v, g, beta, pool, None, a_log, a_log.bfloat16(), None)
    assert not cpu_native_verify.usable(q, k, v, g, beta, pool, None, a_log.half(), a_log, None)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gating", ["fused", "given"])
@pytest.mark.parametrize(("heads", "q_len"), [((2, 4, 32, 16), 1), ((2, 4, 32, 16), 3), ((1, 2, 40, 24), 1)])
def test_decode_step_equals_torch_prep_and_reference(heads, q_len, gating, dtype, threads):
    """Two decode calls (a padding row, bf16 gating weights under bf16, a pool whose slots are strided):
    outputs and the state pool of the one-call step equal the torch-prepared pass's and the reference's."""
    hk, hv, dk, dv = heads
    n = 4
    slots = torch.tensor([2, -1, 0, 5], dtype=torch.int32)
    forms = ("step", "torch_prep", "reference")
    page = randn(6, 2, hv, dv, dk, seed=7, dtype=torch.float32, device=CPU, scale=0.3)
    pools = {f: page.clone()[:, 1] for f in forms}  # slots 2 states apart, as views into vLLM's pages
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(2):
            q, k, v = _tokens(n, q_len, heads, dtype, 70 + step)
            a, b, A_log, dt_bias = gate_inputs((n, q_len), 80 + step, dtype, CPU, hv)
            kwargs = {"A_log": A_log, "dt_bias": dt_bias} if gating == "fused" else {}
            if gating == "given":
                a, b = ref._gate_values(a, b, A_log, dt_bias)
            outs = {}
            for f in forms:
                args = (q, k, v, a, b, pools[f], slots, dk**-0.5)
                outs[f], spy = _run(f, args, kwargs, "gated_delta_rule_recurrent", "decode_step")
                assert spy is None or spy.call_count == 1, "the C step did not run"
            assert outs["step"].dtype == dtype and outs["step"].shape == v.shape
            for other in forms[1:]:
                what = f"decode {step} vs {other}"
                assert_close(outs["step"], outs[other], TOL["outputs", other], f"{what}: outputs")
                assert_close(pools["step"], pools[other], TOL["states", other], f"{what}: state pool")
    finally:
        torch.set_num_threads(before)


def test_step_rejects_out_of_range_values_before_writing():
    """A slot >= S or a num_commit outside [0, R] raises the shared checks' errors from the C step, with
    the pools and ``pending_pos`` untouched."""
    heads = (2, 4, 32, 16)
    n, q_len, num_slots = 3, 2, 4
    q, k, v = _tokens(n, q_len, heads, torch.bfloat16, 90)
    a, b, A_log, dt_bias = gate_inputs((n, q_len), 91, torch.bfloat16, CPU, 4)
    pool = randn(num_slots, 4, 16, 32, seed=92, dtype=torch.float32, device=CPU)
    pending = randn(num_slots, q_len, pending_width(2, 32, 4, 16), seed=93, dtype=torch.float32, device=CPU)
    pos = torch.arange(num_slots, dtype=torch.int32)[:, None]
    saved = pool.clone(), pending.clone(), pos.clone()
    gates = {"A_log": A_log, "dt_bias": dt_bias}
    good_slots, commit = (
        torch.tensor([0, 3, -1], dtype=torch.int32),
        torch.tensor([1, 2, 0], dtype=torch.int32),
    )
    bad_slots = torch.tensor([0, 4, -1], dtype=torch.int32)
    cases = [
        ("decode_step", "gated_delta_rule_recurrent", (q, k, v, a, b, pool, bad_slots, 0.5), r"< S=4.*got 4"),
        (
            "verify_step",
            "gated_delta_rule_verify",
            (q, k, v, a, b, pool, pending, bad_slots, commit, 0.5),
            r"state_indices must be < S=4.*got 4",
        ),
        (
            "verify_step",
            "gated_delta_rule_verify",
            (q, k, v, a, b, pool, pending, good_slots, torch.tensor([1, 3, 0], dtype=torch.int32), 0.5),
            r"num_commit must lie in \[0, R=2\], got values in \[0, 3\]",
        ),
        (
            "verify_step",
            "gated_delta_rule_verify",
            (q, k, v, a, b, pool, pending, good_slots, torch.tensor([1, -1, 0], dtype=torch.int32), 0.5),
            r"num_commit must lie in \[0, R=2\], got values in \[-1, 1\]",
        ),
    ]
    for step, op, args, match in cases:
        kwargs = {**gates, "pending_pos": pos} if step == "verify_step" else gates
        with (
            mock.patch.object(cpu_native_verify, step, wraps=getattr(cpu_native_verify, step)) as spy,
            pytest.raises(ValueError, match=f"{op}: .*{match}"),
        ):
            getattr(cpu, op)(*args, **kwargs)
        assert spy.call_count == 1, f"{op}: the C step did not run"
        for t, s in zip((pool, pending, pos), saved):
            assert torch.equal(t, s), f"{op}: a pool was written before the range error"
