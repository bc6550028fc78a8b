"""The cpu backend's C pass (``cpu_native``) against the backend's torch forms of the same ops.

The conformance tests (test_kernels_gdn*.py) run the cpu backend as it is, so on a machine with a C
compiler they check the C pass against the oracles; here the same calls run with the C pass and with it
switched off (the torch per-slot forms), over several verify steps, on the shapes the pass specialises
(Q = 1..4), the generic one (Q = 5..8), a head dim that is not a multiple of 16, GQA, padding rows, a
pool whose slots are strided (a view into a larger page), and 1 or 2 threads.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from atom_kernels.ops.gated_delta_rule import cpu, cpu_native, cpu_native_verify, pending_width
from atom_kernels.testing import assert_close, gdn_inputs, randn

# (what) -> (atol, rtol). The C pass sums each row's dot products in 16 lanes and a
# pairwise tree, the torch forms in matmuls: float32 rounding of the sums only.
TOL = {
    "outputs": (2e-6, 1e-6),  # measured 1.2e-07 (all cases, 1 and 2 threads)
    "states": (2e-6, 1e-6),  # measured 1.8e-07 (state pool), 2.4e-07 (u in the pending pool)
}

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler builds the pass here")


@contextlib.contextmanager
def _form(native: bool):
    """The C pass with its inputs prepared in torch (spied on, so the test sees it ran; the one-call step
    of ``cpu_native_verify`` switched off) or the torch forms (the pass switched off)."""
    if native:
        with (
            mock.patch.object(cpu_native_verify, "usable", lambda *_: False),
            mock.patch.object(cpu_native, "gdn_pass", wraps=cpu_native.gdn_pass) as spy,
        ):
            yield spy
    else:
        with mock.patch.object(cpu_native, "usable", lambda *_: False) as off:
            yield off


def _pool(slots: int, heads: tuple[int, int, int, int], seed: int, strided: bool) -> torch.Tensor:
    _, hv, dk, dv = heads
    if strided:  # slot states contiguous, slots 2 states apart (a view into a larger page)
        page = randn(
            slots, 2, hv, dv, dk, seed=seed, dtype=torch.float32, device=torch.device("cpu"), scale=0.3
        )
        return page[:, 1]
    return randn(slots, hv, dv, dk, seed=seed, dtype=torch.float32, device=torch.device("cpu"), scale=0.3)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided_slots"])
@pytest.mark.parametrize(
    ("heads", "q_len"),
    [((2, 4, 32, 16), 1), ((2, 4, 32, 16), 2), ((2, 4, 32, 16), 4), ((1, 2, 40, 24), 3), ((2, 2, 48, 16), 6)],
)
def test_verify_native_equals_torch_forms(heads, q_len, strided, threads):
    """Three verify steps with every acceptance count and a padding row: outputs, the state pool, the
    pending pool and ``pending_pos`` of the C pass equal the torch forms'."""
    hk, hv, dk, dv = heads
    n, num_slots = 5, 8
    slots = torch.tensor([6, 1, -1, 3, 0], dtype=torch.int32)
    pools = [_pool(num_slots, heads, 10, strided) for _ in range(2)]
    pendings = [torch.zeros(num_slots, q_len, pending_width(hk, dk, hv, dv)) for _ in range(2)]
    positions = [torch.zeros(num_slots, 1, dtype=torch.int32) for _ in range(2)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(3):
            q, k, v, g, beta = gdn_inputs((n, q_len), 20 + step, torch.float32, torch.device("cpu"), heads)
            commit = torch.tensor([(step + i) % (q_len + 1) for i in range(n)], dtype=torch.int32)
            commit = commit if step else torch.zeros_like(commit)
            outs = []
            for form in range(2):
                with _form(native=form == 0) as spy:
                    outs.append(
                        cpu.gated_delta_rule_verify(
                            q,
                            k,
                            v,
                            g,
                            beta,
                            pools[form],
                            pendings[form],
                            slots,
                            commit,
                            dk**-0.5,
                            pending_pos=positions[form],
                        )  # fmt: skip
                    )
                    assert form or spy.call_count == 1, "the C pass did not run"
            assert_close(outs[0], outs[1], TOL["outputs"], f"step {step}: outputs")
            assert_close(pools[0], pools[1], TOL["states"], f"step {step}: state pool")
            assert_close(pendings[0], pendings[1], TOL["states"], f"step {step}: pending pool")
            assert torch.equal(positions[0], positions[1]), f"step {step}: pending_pos"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "q_len"), [((2, 4, 32, 16), 1), ((2, 4, 32, 16), 3), ((1, 2, 40, 24), 7)])
def test_recurrent_native_equals_torch_forms(heads, q_len, threads):
    """Two decode calls with a padding row: outputs and the state pool of the C pass equal the torch
    forms' (the pass advances each state row after its tokens)."""
    n = 4
    slots = torch.tensor([2, -1, 0, 5], dtype=torch.int32)
    pools = [_pool(6, heads, 30, False) for _ in range(2)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(2):
            q, k, v, g, beta = gdn_inputs((n, q_len), 40 + step, torch.float32, torch.device("cpu"), heads)
            outs = []
            for form in range(2):
                with _form(native=form == 0) as spy:
                    outs.append(
                        cpu.gated_delta_rule_recurrent(q, k, v, g, beta, pools[form], slots, heads[2] ** -0.5)
                    )
                    assert form or spy.call_count == 1, "the C pass did not run"
            assert_close(outs[0], outs[1], TOL["outputs"], f"step {step}: outputs")
            assert_close(pools[0], pools[1], TOL["states"], f"step {step}: state pool")
    finally:
        torch.set_num_threads(before)


def test_native_taken_only_where_it_applies():
    """The pass takes float32 pools with contiguous slot states and at most MAX_TOKENS tokens; a bf16
    pool, a longer call or a missing compiler leaves the torch forms."""
    pool = torch.zeros(4, 2, 16, 32)
    assert cpu_native.usable(pool, 1) and cpu_native.usable(pool, cpu_native.MAX_TOKENS)
    assert not cpu_native.usable(pool, cpu_native.MAX_TOKENS + 1)
    assert not cpu_native.usable(pool.bfloat16(), 1)
    assert not cpu_native.usable(torch.zeros(4, 2, 32, 16).transpose(-1, -2), 1)
    assert cpu_native._compile("/nonexistent/cc", cpu_native.Path("/nonexistent"), "", "gdn_pass") is None
