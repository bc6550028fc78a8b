"""``gated_delta_rule_verify``: MTP verification with deferred commit (docs/kernel-api.md, last section).

Oracles: a per-token design written here (a state slot per verify token, the next step resuming from
the slot of its last accepted token) over several steps with varying acceptance, which must give the same
outputs and committed states (same float32 math, same rounding points); a float64 token loop; the
contract's edge rules (padding rows, ``num_commit = 0``, the zero identity token after a prefill); and the
fused gating (raw a/b, A_log, dt_bias) against the reference gating op followed by the unfused call.
"""

from __future__ import annotations

import pytest
import torch
from atom_kernels.ops.gated_delta_rule import pending_width
from atom_kernels.ops.gated_delta_rule.reference import _delta_step, _prepare_qk, _read_states
from atom_kernels.testing import (
    assert_close,
    gate_inputs,
    gated_delta_rule_loop,
    gdn_inputs,
    gen,
    randn,
    reference_gates,
)

# (what, state dtype) -> (atol, rtol); measured max abs error in the comments (|o| < 1, |S| < 2).
TOL = {
    # Reference vs reference: the same float32 ops in the same order, the same rounding points.
    ("vs_per_token", torch.float32): (0.0, 0.0),  # measured 0 (CPU)
    ("vs_per_token", torch.bfloat16): (0.0, 0.0),  # measured 0 (CPU): one rounding per step in both
    ("vs_per_token_bf16_io", torch.float32): (0.0, 0.0),  # measured 0 (CPU)
    ("vs_per_token_bf16_io", torch.bfloat16): (0.0, 0.0),  # measured 0 (CPU)
    ("vs_naive", torch.float32): (2e-5, 1e-5),  # measured 1.2e-07 (float64 loop, commit + verify)
    # Triton: its own reduction order; a bf16 pool can round the other way (one ulp of |S| ~ 1-2).
    ("vs_per_token", torch.float32, "triton"): (1e-5, 1e-5),  # H200: passed; bench_gdn 7.2e-7
    ("vs_per_token", torch.bfloat16, "triton"): (2e-2, 2e-2),  # H200: passed; bench_gdn 7.8e-3
    ("vs_naive", torch.float32, "triton"): (2e-5, 1e-5),  # H200: passed; fp32 I/O
    # bf16 q/k/v against the torch per-token oracle: its own reduction order, so a bf16 output can round
    # the other way (one ulp of |o| < 0.5); the committed state stays float32-close.
    ("vs_per_token_bf16_io", torch.float32, "triton"): (2e-3, 1e-2),  # interpreter: 9.8e-04
    ("vs_per_token_bf16_io", torch.bfloat16, "triton"): (2e-2, 2e-2),  # as the bf16 pool above
    # cpu: the tokens in closed form from the start state (matmuls): its own order of the sums.
    ("vs_per_token", torch.float32, "cpu"): (1e-5, 1e-5),  # measured 2.4e-07 (states), 4.5e-08 (outputs), CPU
    ("vs_per_token", torch.bfloat16, "cpu"): (
        2e-2,
        2e-2,
    ),  # measured 1.9e-06; a pool rounding may flip one bf16 ulp
    ("vs_per_token_bf16_io", torch.float32, "cpu"): (2e-3, 1e-2),  # measured 4.8e-07, CPU
    ("vs_per_token_bf16_io", torch.bfloat16, "cpu"): (2e-2, 2e-2),  # measured 0, CPU; as the bf16 pool above
    # Fused gating vs the reference gating op + the unfused call over three steps: outputs, the whole
    # state pool and the whole pending pool. The reference is the same code.
    # Fused gating with row-strided a/b (views of one [b | a] projection output) vs contiguous copies:
    # the reference's float32 gate differs by an ulp (CPU: vectorised vs scalar exp loops), Triton's not at all
    ("strided_ab", torch.float32): (1e-6, 1e-6),  # measured 1.2e-07 (reference, CPU), 0 (interpreter)
    ("strided_ab", torch.bfloat16): (2e-2, 2e-2),  # measured 0; a g ulp may flip one bf16 rounding (|S| ~ 2)
    ("fused_gating", torch.float32): (0.0, 0.0),  # measured 0
    ("fused_gating", torch.bfloat16): (0.0, 0.0),  # measured 0
    ("fused_gating_bf16_state", torch.bfloat16): (0.0, 0.0),  # measured 0
    # cpu: the C step computes the gates itself (glibc expf / log1pf vs torch's vectorised exp / log1p):
    # an ulp of g or beta now and then.
    ("fused_gating", torch.float32, "cpu"): (
        1e-6,
        1e-6,
    ),  # measured o 1.9e-08, S 0, pend 9.5e-07 (rel 2.9e-08)
    ("fused_gating", torch.bfloat16, "cpu"): (
        4e-3,
        1e-2,
    ),  # measured o 0, S 6.0e-08, pend 1.9e-06 (rel 1.1e-07)
    # Triton: the kernel's gate expression (log(1 + exp(-|x|))) vs torch's softplus (log1p): an ulp of g.
    ("fused_gating", torch.float32, "triton"): (1e-6, 1e-6),  # interp: o 2e-8, S 1e-7, pend 9.5e-7
    # a g ulp may flip the rounding of a bf16 output (one ulp of |o| < 0.5) or of a bf16 state (|S| ~ 1-2)
    ("fused_gating", torch.bfloat16, "triton"): (4e-3, 1e-2),  # interpreter: outputs and states 0
    ("fused_gating_bf16_state", torch.bfloat16, "triton"): (2e-2, 2e-2),  # interpreter: outputs, states 0
}
HK, HV, DK, DV = 2, 4, 32, 16  # GQA group 2, as test_kernels_gdn.py
SCALE = DK**-0.5
P = pending_width(HK, DK, HV, DV)


def make_inputs(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device):
    return gdn_inputs(shape, seed, dtype, device, (HK, HV, DK, DV))


def naive(q, k, v, g, beta, state):
    return gated_delta_rule_loop(q, k, v, g, beta, state, SCALE)


def per_token_steps(q, k, v, g, beta, ssm_state, slots, first_col, scale):
    """The design deferred commit replaces, in float32 like the reference: sequence n starts from slot
    ``slots[n, first_col[n]]`` and stores the state after token j into ``slots[n, j]`` (carried in
    float32 within the call, rounded when stored). Returns ``o [N, Q, Hv, Dv]`` in q.dtype."""
    init = slots.long().gather(1, first_col.long()[:, None]).squeeze(1)
    state = _read_states(ssm_state, init, init >= 0)
    q32, k32 = _prepare_qk(q, k, v.shape[2], scale, True)
    out = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    for j in range(q.shape[1]):
        state, _ = _delta_step(state, k32[:, j], v.float()[:, j], g.float()[:, j], beta.float()[:, j])
        out[:, j] = (state @ q32[:, j, :, :, None]).squeeze(-1)
        ssm_state[slots[:, j].long()] = state.to(ssm_state.dtype)
    return out.to(q.dtype)


def _channel_major(x: torch.Tensor) -> torch.Tensor:
    """The same values with the last dim strided, as the conv update's output reaches the op."""
    return x.transpose(1, -1).contiguous().transpose(1, -1)


def _drive(impl, dtype, state_dtype, device, accept_plan, q_len, n_slots=8, seed=100, strided=False):
    """Run len(accept_plan) verify steps with both designs on the same tokens; yield per step
    (outputs_verify, outputs_per_token, committed slot states of both)."""
    verify = impl("gated_delta_rule_verify", dtype)
    n = len(accept_plan[0])
    start = randn(n, HV, DV, DK, seed=seed, dtype=torch.float32, device=device, scale=0.3).to(state_dtype)
    # Deferred commit: one slot per sequence (scattered), pending pool [S, R, P].
    slots = torch.randperm(n_slots, generator=gen(seed))[:n].to(torch.int32).to(device)
    pool = torch.zeros(n_slots, HV, DV, DK, dtype=state_dtype, device=device)
    pool[slots.long()] = start
    pending = torch.full((n_slots, q_len, P), float("nan"), device=device)
    pending[slots.long(), 0] = 0.0  # the identity token a prefill leaves behind
    # Per-token design: q_len slots per sequence, the start state in column 0.
    cols = torch.arange(n * q_len, dtype=torch.int32, device=device).reshape(n, q_len)
    pool_pt = torch.zeros(n * q_len, HV, DV, DK, dtype=state_dtype, device=device)
    pool_pt[cols[:, 0].long()] = start
    acc = torch.ones(n, dtype=torch.int32, device=device)  # vLLM's value after a prefill
    for step, nxt in enumerate(accept_plan):
        q, k, v, g, beta = make_inputs((n, q_len), seed + 10 * (step + 1), dtype, device)
        if strided:
            q, k, v = (_channel_major(x) for x in (q, k, v))
        # The state the per-token design resumes from this step == what verify commits at its start.
        committed_pt = pool_pt[cols.gather(1, (acc.long() - 1)[:, None]).squeeze(1).long()].clone()
        o = verify(q, k, v, g, beta, pool, pending, slots, acc, SCALE)
        o_pt = per_token_steps(q, k, v, g, beta, pool_pt, cols, acc - 1, SCALE)
        yield o, o_pt, pool[slots.long()], committed_pt
        acc = torch.tensor(nxt, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "channel_major"])
def test_verify_equals_per_token_states_over_steps(impl, tol, device, dtype, state_dtype, strided):
    """Four verify steps (k = 3) with every acceptance count: outputs and committed states equal the
    per-token design's outputs and the state it would resume from (also for strided q/k/v, the layout
    the conv update hands over: the replay reads contiguous pending tokens and must round alike)."""
    plan = [[1, 4, 2, 3], [4, 1, 3, 2], [2, 2, 4, 1], [3, 4, 1, 4]]
    t = tol("vs_per_token" if dtype == torch.float32 else "vs_per_token_bf16_io", state_dtype)
    for step, (o, o_pt, committed, committed_pt) in enumerate(
        _drive(impl, dtype, state_dtype, device, plan, 4, strided=strided)
    ):
        assert_close(o, o_pt, t, f"step {step}: outputs, q {dtype}, state {state_dtype}")
        assert_close(committed.float(), committed_pt.float(), t, f"step {step}: committed state")


def _check_vs_float64_loop(fn, tol, device, q_len: int) -> None:
    """Commit a tokens of step 1, verify step 2: outputs == float64 loop over (step1[:a] ++ step2)."""
    n = 3
    q, k, v, g, beta = make_inputs((n, 2 * q_len), 200, torch.float32, device)
    start = randn(n, HV, DV, DK, seed=209, dtype=torch.float32, device=device, scale=0.3)
    pool, slots = start.clone(), torch.arange(n, dtype=torch.int32, device=device)
    pending = torch.zeros(n, q_len, P, device=device)
    first = [t[:, :q_len] for t in (q, k, v, g, beta)]
    second = [t[:, q_len:] for t in (q, k, v, g, beta)]
    o1 = fn(*first, pool, pending, slots, torch.zeros(n, dtype=torch.int32, device=device), SCALE)
    accepted = torch.tensor([1, q_len, min(2, q_len)], dtype=torch.int32, device=device)
    o2 = fn(*second, pool, pending, slots, accepted, SCALE)
    t = tol("vs_naive", torch.float32)
    for i in range(n):
        a = int(accepted[i])
        o_ref1, _ = naive(*[x[i] for x in first], start[i])
        assert_close(o1[i], o_ref1, t, f"step 1 outputs, seq {i}")
        seq = [torch.cat([x[i, :a], y[i]]) for x, y in zip(first, second)]
        o_ref, states = naive(*seq, start[i])
        assert_close(o2[i], o_ref[a:], t, f"step 2 outputs, seq {i}, a={a}")
        assert_close(pool[i], states[a - 1], t, f"committed state, seq {i}, a={a}")


def test_verify_matches_float64_loop(impl, tol, device):
    """Commit a tokens of step 1, verify step 2 (3 tokens): outputs == the float64 loop."""
    _check_vs_float64_loop(impl("gated_delta_rule_verify", torch.float32), tol, device, 3)


@pytest.mark.parametrize("wy", [True, False], ids=["wy", "seq"])
@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_triton_token_forms_match_float64_loop(impl, tol, device, backend, wy, q_len):
    """Both token sections of the Triton kernel, the WY form and one token after another, whichever its
    launch default picks for q_len (WY up to 2 tokens): the float64-loop oracle above."""
    if backend != "triton":
        pytest.skip("the token form is a launch setting of the Triton kernel")
    impl("gated_delta_rule_verify", torch.float32)  # skips where the Triton op cannot run
    from atom_kernels.ops.gated_delta_rule.triton_verify import VerifyLaunch, _launch_verify

    def fn(*args):
        launch = VerifyLaunch(block_v=8, num_warps=1, wy=wy, max_registers=None)
        return _launch_verify(*args, launch=launch)

    _check_vs_float64_loop(fn, tol, device, q_len)


def _update_coefficients(q, k, v, g, beta, state):
    """float64 ``u_j = beta_j (v_j - (S_{j-1} exp(g_j)) k_j)`` [L, HV, DV] of one sequence's tokens."""
    _, states = naive(q, k, v, g, beta, state)
    kn = k.double().cpu()
    kn = (kn / torch.sqrt((kn * kn).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(HV // HK, 1)
    prev = [state.double().cpu()] + states[:-1]
    return torch.stack(
        [beta[j].double().cpu()[:, None] * (v[j].double().cpu() - torch.einsum(
            "hvk,hk->hv", prev[j] * g[j].double().cpu().exp()[:, None, None], kn[j]))
         for j in range(k.shape[0])]
    )  # fmt: skip


def test_padding_rows_and_zero_commit(impl, device):
    """A slot < 0 touches no pool row; num_commit = 0 commits nothing; a zero pending token is the
    identity; pending rows past Q keep their contents; ``pending_pos`` advances by ``num_commit`` on the
    listed slots only."""
    fn = impl("gated_delta_rule_verify", torch.float32)
    n, q_len, r = 3, 2, 4
    q, k, v, g, beta = make_inputs((n, q_len), 300, torch.float32, device)
    pool = randn(4, HV, DV, DK, seed=301, dtype=torch.float32, device=device, scale=0.3)
    pending = randn(4, r, P, seed=302, dtype=torch.float32, device=device)
    pending[2, 0] = 0.0
    slots = torch.tensor([1, -1, 2], dtype=torch.int32, device=device)
    acc = torch.tensor([0, 3, 1], dtype=torch.int32, device=device)
    pool0, pending0 = pool.clone(), pending.clone()
    pos = torch.tensor([[5], [17], [30], [41]], dtype=torch.int32, device=device)
    o = fn(q, k, v, g, beta, pool, pending, slots, acc, SCALE, pending_pos=pos)
    exact = (0.0, 0.0)
    assert pos.view(-1).tolist() == [5, 17 + 0, 30 + 1, 41], f"pending_pos {pos.view(-1).tolist()}"
    assert_close(pool[1], pool0[1], exact, "num_commit 0 commits nothing")
    assert_close(pool[2], pool0[2], exact, "a zero pending token is the identity")
    for s in (0, 3):
        assert_close(pool[s], pool0[s], exact, f"unlisted slot {s} state")
        assert_close(pending[s], pending0[s], exact, f"unlisted slot {s} pending (also the padding row's)")
    for s in (1, 2):
        assert_close(pending[s, q_len:], pending0[s, q_len:], exact, f"slot {s} pending rows >= Q")
        i = int((slots == s).nonzero())
        kd, vd = HK * DK, HV * DV
        assert_close(pending[s, :q_len, :kd], k[i].flatten(1), exact, f"slot {s} stashed raw k")
        assert_close(pending[s, :q_len, kd + vd :], g[i], exact, f"slot {s} stashed g")
        u_ref = _update_coefficients(q[i], k[i], v[i], g[i], beta[i], pool0[s]).flatten(1)
        assert_close(pending[s, :q_len, kd : kd + vd], u_ref, (2e-5, 1e-5), f"slot {s} stashed u")
    o_pad, _ = naive(q[1], k[1], v[1], g[1], beta[1], torch.zeros(HV, DV, DK))
    assert_close(o[1], o_pad, (2e-5, 1e-5), "padding row computes from a zero state")


def test_bad_inputs(impl, device):
    fn = impl("gated_delta_rule_verify", torch.float32)
    n, q_len = 2, 3
    q, k, v, g, beta = make_inputs((n, q_len), 400, torch.float32, device)
    pool = torch.zeros(4, HV, DV, DK, device=device)
    pending = torch.zeros(4, q_len, P, device=device)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=device)
    acc = torch.ones(n, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"Q=3 must fit the pending buffer \(R=2"):
        fn(q, k, v, g, beta, pool, pending[:, :2], slots, acc, SCALE)
    with pytest.raises(ValueError, match=rf"pending must have shape \[S=4, R, P={P}\]"):
        fn(q, k, v, g, beta, pool, pending[..., 1:], slots, acc, SCALE)
    with pytest.raises(ValueError, match="pending must have dtype float32"):
        fn(q, k, v, g, beta, pool, pending.bfloat16(), slots, acc, SCALE)
    with pytest.raises(ValueError, match="num_commit must have dtype int32"):
        fn(q, k, v, g, beta, pool, pending, slots, acc.long(), SCALE)
    with pytest.raises(ValueError, match=r"pending_pos must have shape \[S=4, 1\]"):
        fn(q, k, v, g, beta, pool, pending, slots, acc, SCALE, pending_pos=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="pending_pos must have dtype int32"):
        fn(
            q,
            k,
            v,
            g,
            beta,
            pool,
            pending,
            slots,
            acc,
            SCALE,
            pending_pos=torch.zeros(4, 1, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match=r"state_indices must have shape \[N=2\]"):
        fn(q, k, v, g, beta, pool, pending, slots[:, None].expand(n, q_len), acc, SCALE)
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"num_commit must lie in \[0, R=3\], got values in \[1, 4\]"):
            fn(q, k, v, g, beta, pool, pending, slots, acc * torch.tensor([1, 4], device=device).int(), SCALE)
        with pytest.raises(ValueError, match="state_indices must be < S=4"):
            fn(q, k, v, g, beta, pool, pending, slots + 3, acc, SCALE)


@pytest.mark.parametrize(
    "dtype, state_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["f32", "bf16_io", "bf16_io_bf16_state"],
)
@pytest.mark.parametrize("q_len", [2, 4], ids=["k1", "k3"])
@pytest.mark.parametrize("gating", ["in_kernel", "op_first"])
def test_verify_fused_gating_equals_unfused(impl, tol, device, backend, dtype, state_dtype, q_len, gating):
    """Three verify steps (k = 1 or 3, every acceptance count, a padding row) with the gating fused in:
    outputs, the whole state pool and the whole pending pool (its stashed g is the computed one) equal the
    reference gating op followed by the unfused call on the same pools. ``op_first``: the Triton launch
    setting that runs the gating op before the unfused kernels (its default for long verifies of >= 64
    sequences)."""
    fn = impl("gated_delta_rule_verify", dtype)
    fused = fn
    if gating == "op_first":
        if backend != "triton":
            pytest.skip("where the gate is computed is a launch setting of the Triton kernel")
        from atom_kernels.ops.gated_delta_rule.triton_verify import VerifyLaunch, _launch_verify

        launch = VerifyLaunch(block_v=8, num_warps=1, wy=q_len <= 2, max_registers=None, fuse_gating=False)

        def fused(*args, **kwargs):
            return _launch_verify(*args, launch=launch, **kwargs)

    n, n_slots = 4, 8
    slots = torch.tensor([5, -1, 0, 3], dtype=torch.int32, device=device)
    pool = randn(n_slots, HV, DV, DK, seed=500, dtype=torch.float32, device=device, scale=0.3)
    pool = pool.to(state_dtype)
    pending = randn(n_slots, q_len, P, seed=501, dtype=torch.float32, device=device, scale=0.1)
    pending[slots.long().clamp(min=0), 0] = 0.0  # the identity token a prefill leaves behind
    pools = {"unfused": (pool.clone(), pending.clone()), "fused": (pool, pending)}
    plan = [[1, 1, 1, 1], [q_len, 2, 1, 2], [2, q_len, q_len, 1]]
    t = tol("fused_gating" if state_dtype == torch.float32 else "fused_gating_bf16_state", dtype)
    for step, accepted in enumerate(plan):
        acc = torch.tensor(accepted, dtype=torch.int32, device=device)
        q, k, v, _, _ = make_inputs((n, q_len), 510 + 10 * step, dtype, device)
        a, b, A_log, dt_bias = gate_inputs((n, q_len), 515 + 10 * step, dtype, device, HV)
        g, beta = reference_gates(a, b, A_log, dt_bias)
        o_u = fn(q, k, v, g, beta, *pools["unfused"], slots, acc, SCALE)
        before = tuple(p.clone() for p in pools["fused"])  # a/b: row-strided views (gate_inputs)
        o_f = fused(q, k, v, a, b, *pools["fused"], slots, acc, SCALE, A_log=A_log, dt_bias=dt_bias)
        o_c = fused(
            q, k, v, a.contiguous(), b.contiguous(), *before, slots, acc, SCALE, A_log=A_log, dt_bias=dt_bias
        )
        ts, what_s = (
            tol("strided_ab", dtype),
            f"fused gating, step {step}, Q={q_len}: strided a/b vs contiguous",
        )
        assert_close(o_f, o_c, ts, what_s)
        for x, y, part in zip(pools["fused"], before, ("states", "pending")):
            assert_close(x.float(), y.float(), ts, f"{what_s} ({part})")
        what = f"step {step}, q {dtype}, state {state_dtype}, Q={q_len}"
        assert_close(o_f, o_u, t, f"fused vs unfused outputs, {what}")
        assert_close(pools["fused"][0].float(), pools["unfused"][0].float(), t, f"state pool, {what}")
        assert_close(pools["fused"][1], pools["unfused"][1], t, f"pending pool, {what}")


def test_verify_fused_gating_bad_inputs(impl, device):
    fn = impl("gated_delta_rule_verify", torch.float32)
    q, k, v, _, _ = make_inputs((2, 2), 520, torch.float32, device)
    a, b, A_log, dt_bias = gate_inputs((2, 2), 521, torch.float32, device, HV)
    pool, pending = torch.zeros(2, HV, DV, DK, device=device), torch.zeros(2, 2, P, device=device)
    slots, acc = (
        torch.arange(2, dtype=torch.int32, device=device),
        torch.ones(2, dtype=torch.int32, device=device),
    )
    with pytest.raises(ValueError, match="fused gating needs both A_log and dt_bias"):
        fn(q, k, v, a, b, pool, pending, slots, acc, SCALE, dt_bias=dt_bias)
    with pytest.raises(ValueError, match=r"dt_bias must have shape \[Hv=4\]"):
        fn(q, k, v, a, b, pool, pending, slots, acc, SCALE, A_log=A_log, dt_bias=dt_bias[None])
    with pytest.raises(ValueError, match=r"b \(passed as beta\) must have shape \[N=2, Q=2, Hv=4\]"):
        fn(q, k, v, a, b[:, :1], pool, pending, slots, acc, SCALE, A_log=A_log, dt_bias=dt_bias)
