"""Gated DeltaNet: gating, l2norm, and the chunked / recurrent gated delta rule.

Oracles: a float64 per-token loop written here, self-consistency (chunked == recurrent, varlen == alone,
one multi-token recurrent call == the same tokens one at a time, fused gating == the reference gating op
followed by the unfused call) and transformers' torch_chunk_gated_delta_rule /
torch_recurrent_gated_delta_rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_kernels.testing import (
    assert_close,
    gate_inputs,
    gated_delta_rule_loop,
    gdn_inputs,
    gen,
    randn,
    reference_gates,
)

# (what, dtype) -> (atol, rtol); dtype is q/k/v's (the state is float32 unless the test says bf16).
# Measured max abs error (CPU, reference) in the comments; |o| is up to ~1, states up to ~2.
TOL = {
    ("gating", torch.float32): (1e-6, 1e-6),  # measured 4.5e-07
    ("gating", torch.bfloat16): (1e-6, 1e-6),  # measured 5.1e-07 (bf16 inputs, float32 math)
    ("l2norm", torch.float32): (1e-6, 1e-6),  # measured 6.4e-08
    ("l2norm", torch.bfloat16): (4e-3, 1e-2),  # measured 1.9e-03
    ("gdr_vs_naive", torch.float32): (2e-5, 1e-5),  # measured 1.7e-06 (final states), 2.8e-07 (outputs)
    ("gdr_vs_naive", torch.bfloat16): (3e-3, 1e-2),  # measured 9.2e-04 (bf16 output rounding, |o| < 0.5)
    ("gdr_self", torch.float32): (2e-5, 1e-5),  # measured 6.6e-07 chunked vs recurrent
    ("gdr_self", torch.bfloat16): (5e-4, 1e-2),  # measured 6.1e-05
    ("state_bf16", torch.float32): (1e-2, 1e-2),  # measured 3.9e-03: final states stored in bf16
    ("self_exact", torch.float32): (1e-6, 1e-6),  # measured 0: varlen vs alone, verify vs single decode
    ("hf", torch.float32): (2e-5, 1e-5),  # measured 0 (chunk) and 2.4e-07 (recurrent) vs transformers
    # Fused gating (A_log/dt_bias given) vs the reference gdn_gating op + the unfused call, outputs and
    # states; keyed by q/k/v dtype, "_bf16_state" for a bf16 pool. The reference is the same code.
    # Fused gating with row-strided a/b (views of one [b | a] projection output) vs contiguous copies:
    # the reference's float32 gate differs by an ulp (CPU: vectorised vs scalar exp loops), Triton's not at all
    ("strided_ab", torch.float32): (1e-6, 1e-6),  # measured 1.2e-07 (reference, CPU), 0 (interpreter)
    ("strided_ab", torch.bfloat16): (2e-2, 2e-2),  # measured 0; a g ulp may flip one bf16 rounding (|S| ~ 2)
    ("fused_gating", torch.float32): (0.0, 0.0),  # measured 0
    ("fused_gating", torch.bfloat16): (0.0, 0.0),  # measured 0
    ("fused_gating_bf16_state", torch.bfloat16): (0.0, 0.0),  # measured 0
    # cpu: the C step computes the gates itself (glibc expf / log1pf vs torch's vectorised exp / log1p):
    # an ulp of g or beta now and then.
    ("fused_gating", torch.float32, "cpu"): (1e-6, 1e-6),  # measured outputs and states 0 (Q = 1, 3)
    ("fused_gating", torch.bfloat16, "cpu"): (
        4e-3,
        1e-2,
    ),  # measured outputs 0, states 6.0e-08; a g ulp may flip a bf16 output
    # Triton: the kernel's gate expression (log(1 + exp(-|x|))) vs torch's softplus (log1p): an ulp of g.
    ("fused_gating", torch.float32, "triton"): (1e-6, 1e-6),  # interpreter: outputs 2.2e-08, states 1.2e-07
    # a g ulp may flip the rounding of a bf16 output (one ulp of |o| < 0.5) or of a bf16 state (|S| ~ 1-2)
    ("fused_gating", torch.bfloat16, "triton"): (4e-3, 1e-2),  # interpreter: outputs and states 0
    ("fused_gating_bf16_state", torch.bfloat16, "triton"): (2e-2, 2e-2),  # interpreter: outputs, states 0
    # Triton chunked prefill wraps fla-core's chunk_gated_delta_rule, whose dots take bf16 operands
    # (measured on the H200): final states off by 4.7e-03..6.8e-03, chunked vs
    # recurrent outputs by 1.95e-03 (two bf16 steps). Its float32 path is not registered (tf32 dots).
    ("gdr_vs_naive", torch.bfloat16, "triton"): (1e-2, 1e-2),  # measured 6.8e-03 (H200)
    # chunked vs recurrent: outputs 1.95e-03 (H200); final states 8.5e-03 (H100, 14 test processes on one
    # GPU: fla-core autotunes its chunk kernels by timing, so the tiles it picks, and their bf16 roundings,
    # vary with the load), the size of the chunked-vs-naive state error above
    ("gdr_self", torch.bfloat16, "triton"): (1e-2, 1e-2),
}
DTYPES = [torch.float32, torch.bfloat16]
HK, HV, DK, DV = 2, 4, 32, 16
SCALE = DK**-0.5


def make_inputs(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device):
    """q, k [*shape, HK, DK], v [*shape, HV, DV] in dtype; g, beta [*shape, HV] float32 like the model."""
    return gdn_inputs(shape, seed, dtype, device, (HK, HV, DK, DV))


def naive(q, k, v, g, beta, state, scale=SCALE, l2=True):
    """float64 token loop for one sequence: q, k [L, HK, DK]; state [HV, DV, DK]. Returns (o, states)."""
    return gated_delta_rule_loop(q, k, v, g, beta, state, scale, l2)


def test_gdn_gating(impl, tol, device):
    for dtype in DTYPES:
        fn = impl("gdn_gating", dtype)
        a, b = (
            randn(65, HV, seed=1, dtype=dtype, device=device),
            randn(65, HV, seed=2, dtype=dtype, device=device),
        )
        a_log, dt_bias = (
            randn(HV, seed=3, dtype=dtype, device=device),
            randn(HV, seed=4, dtype=dtype, device=device),
        )
        g, beta = fn(a_log, a, dt_bias, b)
        assert g.dtype == torch.float32 and beta.dtype == torch.float32
        expected_g = -a_log.double().exp() * F.softplus(a.double() + dt_bias.double())
        assert_close(g, expected_g, tol("gating", dtype), f"gdn_gating g {dtype}")
        assert_close(beta, torch.sigmoid(b.double()), tol("gating", dtype), f"gdn_gating beta {dtype}")
        with pytest.raises(ValueError, match=r"dt_bias must have shape \[Hv=4\]"):
            fn(a_log, a, dt_bias[:3], b)


def test_gdn_gating_row_strided(impl, tol, device):
    """``a``/``b`` as the GDN layer passes them (``[b | a]`` column slices of one projection output): the
    contiguous call's ``g``/``beta``."""
    fn = impl("gdn_gating", torch.float32)
    ba = randn(33, 2 * HV, seed=5, dtype=torch.float32, device=device, scale=3.0)
    a_log, dt_bias = (
        randn(HV, seed=6, dtype=torch.float32, device=device),
        randn(HV, seed=7, dtype=torch.float32, device=device),
    )
    want = fn(a_log, ba[:, HV:].contiguous(), dt_bias, ba[:, :HV].contiguous())
    got = fn(a_log, ba[:, HV:], dt_bias, ba[:, :HV])
    assert ba[:, HV:].stride(0) == 2 * HV
    for name, x, y in zip(("g", "beta"), got, want):
        assert_close(x, y, tol("strided_ab", torch.float32), f"gdn_gating {name}: strided a/b vs contiguous")


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm(impl, tol, device, dtype):
    fn = impl("l2norm", dtype)
    x = randn(63, HK, DK, seed=5, dtype=dtype, device=device)
    y = fn(x)
    x64 = x.double()
    assert y.dtype == dtype
    assert_close(
        y, x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) + 1e-6), tol("l2norm", dtype), "l2norm"
    )
    with pytest.raises(ValueError, match="eps must be a positive number"):
        fn(x, eps=-1.0)


def varlen_batch(lens: list[int], seed: int, dtype, device, num_slots: int):
    q, k, v, g, beta = make_inputs((sum(lens),), seed, dtype, device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    pool = randn(num_slots, HV, DV, DK, seed=seed + 9, dtype=torch.float32, device=device, scale=0.3)
    return q, k, v, g, beta, cu, pool


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[1], [63], [65], [257], [65, 1, 257, 63]])
@pytest.mark.parametrize("slot_order", ["reversed", "consecutive"])
def test_chunked_matches_naive(impl, tol, device, dtype, lens, slot_order):
    """Against the float64 loop; slots in reversed order, or consecutive (the cpu backend then updates a
    float32 pool's rows in place)."""
    fn = impl("gated_delta_rule_chunked", dtype)
    q, k, v, g, beta, cu, pool = varlen_batch(lens, 10, dtype, device, num_slots=len(lens) + 2)
    if slot_order == "reversed":
        slots = torch.arange(len(lens), 0, -1, dtype=torch.int32, device=device)
    else:
        slots = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=device)
    has_init = torch.tensor([i % 2 == 0 for i in range(len(lens))], device=device)
    before = pool.clone()
    o = fn(q, k, v, g, beta, cu, pool, slots, has_init, SCALE)
    assert o.dtype == dtype and o.shape == v.shape
    offs = cu.tolist()
    for n in range(len(lens)):
        s, e = offs[n], offs[n + 1]
        init = before[slots[n]] if has_init[n] else torch.zeros_like(before[0])
        o_ref, states = naive(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
        assert_close(o[s:e], o_ref, tol("gdr_vs_naive", dtype), f"chunked o seq {n} len {lens[n]} {dtype}")
        assert_close(pool[slots[n]], states[-1], tol("gdr_vs_naive", dtype), f"chunked final state seq {n}")
    untouched = [i for i in range(pool.shape[0]) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched]), "slots of no sequence must stay untouched"


def test_chunked_varlen_equals_each_alone(impl, tol, device):
    fn = impl("gated_delta_rule_chunked", torch.float32)
    lens = [63, 1, 65, 257, 64]
    q, k, v, g, beta, cu, pool = varlen_batch(lens, 20, torch.float32, device, num_slots=len(lens))
    slots = torch.arange(len(lens), dtype=torch.int32, device=device)
    has_init = torch.ones(len(lens), dtype=torch.bool, device=device)
    pool_alone = pool.clone()
    o = fn(q, k, v, g, beta, cu, pool, slots, has_init, SCALE)
    offs = cu.tolist()
    for n in range(len(lens)):
        s, e = offs[n], offs[n + 1]
        cu1 = torch.tensor([0, e - s], dtype=torch.int32, device=device)
        o1 = fn(
            q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], cu1, pool_alone, slots[n : n + 1], has_init[:1], SCALE
        )
        assert_close(o[s:e], o1, tol("self_exact", torch.float32), f"varlen vs alone, output of seq {n}")
    assert_close(pool, pool_alone, tol("self_exact", torch.float32), "varlen vs alone, final states")


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_equals_recurrent(impl, tol, device, dtype):
    """Three sequences of 65 tokens: the chunked prefill and a 65-token recurrent call agree."""
    chunked, recurrent = impl("gated_delta_rule_chunked", dtype), impl("gated_delta_rule_recurrent", dtype)
    n, length = 3, 65
    q, k, v, g, beta = make_inputs((n, length), 30, dtype, device)
    pool = randn(4, HV, DV, DK, seed=39, dtype=torch.float32, device=device, scale=0.3)
    pool_rec = pool.clone()
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    cu = torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device=device)
    flat = [t.reshape(n * length, *t.shape[2:]) for t in (q, k, v, g, beta)]
    o_chunk = chunked(*flat, cu, pool, slots, torch.ones(n, dtype=torch.bool, device=device), SCALE)
    o_rec = recurrent(q, k, v, g, beta, pool_rec, slots, SCALE)
    tol = tol("gdr_self", dtype)
    assert_close(o_chunk, o_rec.reshape(n * length, HV, DV), tol, f"chunked vs recurrent outputs {dtype}")
    assert_close(pool, pool_rec, tol, f"chunked vs recurrent final states {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_recurrent_matches_naive(impl, tol, device, dtype, state_dtype):
    """Q = 4 tokens from each slot's state; the final state back in the slot; a padding row (slot -1)
    computes from a zero state and writes nothing; other slots stay untouched."""
    fn = impl("gated_delta_rule_recurrent", dtype)
    n, qlen = 4, 4
    q, k, v, g, beta = make_inputs((n, qlen), 40, dtype, device)
    pool = randn(16, HV, DV, DK, seed=49, dtype=torch.float32, device=device, scale=0.3).to(state_dtype)
    slots = torch.randperm(16, generator=gen(1))[:n].to(torch.int32).to(device)
    slots[2] = -1  # padding row
    before = pool.clone()
    o = fn(q, k, v, g, beta, pool, slots, SCALE)
    assert o.shape == v.shape and o.dtype == dtype
    tol = tol("gdr_vs_naive", dtype) if state_dtype == torch.float32 else tol("state_bf16", torch.float32)
    for i in range(n):
        init = before[slots[i]] if slots[i] >= 0 else torch.zeros(HV, DV, DK, device=device)
        o_ref, states = naive(q[i], k[i], v[i], g[i], beta[i], init)
        assert_close(o[i], o_ref, tol, f"recurrent o seq {i} {dtype} state {state_dtype}")
        if slots[i] >= 0:
            assert_close(pool[slots[i]], states[-1], tol, f"recurrent final state seq {i}")
    unlisted = ~torch.isin(torch.arange(16), slots.cpu())
    assert torch.equal(pool[unlisted.to(device)], before[unlisted.to(device)]), (
        "unlisted slots must stay untouched"
    )


def test_multi_token_call_equals_one_at_a_time(impl, tol, device):
    """A Q = 4 call == 4 single-token calls on the same slots (outputs and final state)."""
    fn = impl("gated_delta_rule_recurrent", torch.float32)
    n, qlen = 3, 4
    q, k, v, g, beta = make_inputs((n, qlen), 50, torch.float32, device)
    start = randn(n, HV, DV, DK, seed=59, dtype=torch.float32, device=device, scale=0.3)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    pool = start.clone()
    o = fn(q, k, v, g, beta, pool, slots, SCALE)
    single = start.clone()
    for j in range(qlen):
        oj = fn(*[t[:, j : j + 1] for t in (q, k, v, g, beta)], single, slots, SCALE)
        assert_close(o[:, j : j + 1], oj, tol("self_exact", torch.float32), f"output of token {j}")
    assert_close(pool, single, tol("self_exact", torch.float32), "final states")


@pytest.mark.parametrize(
    "dtype, state_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["f32", "bf16_io", "bf16_io_bf16_state"],
)
@pytest.mark.parametrize("q_len", [1, 3])
def test_recurrent_fused_gating_equals_unfused(impl, tol, device, dtype, state_dtype, q_len):
    """Decode (Q = 1) and Q = 3 with the gating fused in (raw a/b, A_log, dt_bias): outputs and the whole
    state pool equal the reference gating op followed by the unfused call (a padding row included)."""
    fn = impl("gated_delta_rule_recurrent", dtype)
    n = 4
    q, k, v, _, _ = make_inputs((n, q_len), 130, dtype, device)
    a, b, A_log, dt_bias = gate_inputs((n, q_len), 131, dtype, device, HV)
    pool = randn(8, HV, DV, DK, seed=132, dtype=torch.float32, device=device, scale=0.3).to(state_dtype)
    slots = torch.tensor([5, -1, 0, 3], dtype=torch.int32, device=device)
    g, beta = reference_gates(a, b, A_log, dt_bias)
    pool_u, pool_f = pool.clone(), pool.clone()
    o_u = fn(q, k, v, g, beta, pool_u, slots, SCALE)
    o_f = fn(q, k, v, a, b, pool_f, slots, SCALE, A_log=A_log, dt_bias=dt_bias)
    t = tol("fused_gating" if state_dtype == torch.float32 else "fused_gating_bf16_state", dtype)
    pool_c = pool.clone()  # a/b are row-strided views (gate_inputs); contiguous copies give the same
    o_c = fn(q, k, v, a.contiguous(), b.contiguous(), pool_c, slots, SCALE, A_log=A_log, dt_bias=dt_bias)
    ts = tol("strided_ab", dtype)
    assert_close(o_f, o_c, ts, f"fused gating, Q={q_len}, state {state_dtype}: strided a/b vs contiguous")
    assert_close(pool_f.float(), pool_c.float(), ts, f"fused gating, Q={q_len}: states, strided a/b")
    assert o_f.dtype == dtype and o_f.shape == v.shape
    assert_close(o_f, o_u, t, f"fused vs unfused outputs, q {dtype}, state {state_dtype}, Q={q_len}")
    assert_close(pool_f.float(), pool_u.float(), t, f"fused vs unfused state pool, state {state_dtype}")


def test_fused_gating_bad_inputs(impl, device):
    fn = impl("gated_delta_rule_recurrent", torch.float32)
    q, k, v, _, _ = make_inputs((2, 1), 140, torch.float32, device)
    a, b, A_log, dt_bias = gate_inputs((2, 1), 141, torch.float32, device, HV)
    pool = torch.zeros(2, HV, DV, DK, device=device)
    slots = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="fused gating needs both A_log and dt_bias"):
        fn(q, k, v, a, b, pool, slots, SCALE, A_log=A_log)
    with pytest.raises(ValueError, match=r"A_log must have shape \[Hv=4\]"):
        fn(q, k, v, a, b, pool, slots, SCALE, A_log=A_log[:3], dt_bias=dt_bias)
    with pytest.raises(ValueError, match=r"a \(passed as g\) must have shape \[N=2, Q=1, Hv=4\]"):
        fn(q, k, v, a[..., :3], b, pool, slots, SCALE, A_log=A_log, dt_bias=dt_bias)


def test_matches_transformers(impl, tol, device):
    import inspect

    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    # The plain torch functions: with fla installed, transformers' wrappers dispatch to fla's kernels.
    torch_chunk_gated_delta_rule = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    torch_recurrent_gated_delta_rule = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)

    chunked, recurrent = (
        impl("gated_delta_rule_chunked", torch.float32),
        impl("gated_delta_rule_recurrent", torch.float32),
    )
    length = 65
    q, k, v, g, beta = make_inputs((1, length), 60, torch.float32, device)
    init = randn(1, HV, DV, DK, seed=69, dtype=torch.float32, device=device, scale=0.3)
    rep = HV // HK
    hf_args = (
        q.repeat_interleave(rep, 2).cpu(),
        k.repeat_interleave(rep, 2).cpu(),
        v.cpu(),
        g.cpu(),
        beta.cpu(),
    )
    hf_init = init.transpose(-1, -2).cpu()  # [B, H, Dk, Dv]
    o_hf, s_hf = torch_chunk_gated_delta_rule(
        *hf_args, chunk_size=64, initial_state=hf_init, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o_hf_rec, s_hf_rec = torch_recurrent_gated_delta_rule(
        *hf_args, initial_state=hf_init, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    tol = tol("hf", torch.float32)
    pool = init.clone()
    cu = torch.tensor([0, length], dtype=torch.int32, device=device)
    slot = torch.zeros(1, dtype=torch.int32, device=device)
    o = chunked(
        q[0], k[0], v[0], g[0], beta[0], cu, pool, slot, torch.ones(1, dtype=torch.bool, device=device), SCALE
    )
    assert_close(o, o_hf[0], tol, "chunked vs transformers chunk output")
    assert_close(pool[0].transpose(-1, -2), s_hf[0], tol, "chunked vs transformers chunk final state")
    pool = init.clone()
    o = recurrent(q, k, v, g, beta, pool, slot, SCALE)
    assert_close(o, o_hf_rec, tol, "recurrent vs transformers recurrent output")
    assert_close(
        pool[0].transpose(-1, -2), s_hf_rec[0], tol, "recurrent vs transformers recurrent final state"
    )


def test_no_l2norm_and_custom_scale(impl, tol, device):
    fn = impl("gated_delta_rule_recurrent", torch.float32)
    q, k, v, g, beta = make_inputs((1, 5), 70, torch.float32, device)
    k = F.normalize(k, dim=-1) * 0.8
    pool = torch.zeros(1, HV, DV, DK, device=device)
    o = fn(
        q,
        k,
        v,
        g,
        beta,
        pool,
        torch.zeros(1, dtype=torch.int32, device=device),
        0.5,
        use_qk_l2norm=False,
    )
    o_ref, states = naive(q[0], k[0], v[0], g[0], beta[0], torch.zeros(HV, DV, DK), scale=0.5, l2=False)
    assert_close(o[0], o_ref, tol("gdr_vs_naive", torch.float32), "recurrent without l2norm")
    assert_close(pool[0], states[-1], tol("gdr_vs_naive", torch.float32), "recurrent without l2norm, state")


def test_bad_inputs(impl, device):
    chunked, recurrent = (
        impl("gated_delta_rule_chunked", torch.float32),
        impl("gated_delta_rule_recurrent", torch.float32),
    )
    q, k, v, g, beta = make_inputs((6,), 80, torch.float32, device)
    pool = torch.zeros(2, HV, DV, DK, device=device)
    cu = torch.tensor([0, 6], dtype=torch.int32, device=device)
    slot = torch.zeros(1, dtype=torch.int32, device=device)
    init = torch.zeros(1, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match=r"ssm_state must have shape \[S, Hv=4, Dv=16, Dk=32\]"):
        chunked(q, k, v, g, beta, cu, pool.transpose(-1, -2), slot, init, SCALE)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[N\+1=2\]"):
        chunked(q, k, v, g, beta, cu[:1], pool, slot, init, SCALE)
    with pytest.raises(ValueError, match="cu_seqlens must have dtype int32"):
        chunked(q, k, v, g, beta, cu.long(), pool, slot, init, SCALE)
    with pytest.raises(ValueError, match="Hv=4 must be a multiple of the key heads Hk=3"):
        chunked(q[:, :1].expand(6, 3, DK), k[:, :1].expand(6, 3, DK), v, g, beta, cu, pool, slot, init, SCALE)
    with pytest.raises(ValueError, match="k must have dtype float32"):
        chunked(q, k.bfloat16(), v, g, beta, cu, pool, slot, init, SCALE)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T=6"):
            chunked(q, k, v, g, beta, cu - 1, pool, slot, init, SCALE)
        with pytest.raises(ValueError, match="state_indices must be < S=2"):
            chunked(q, k, v, g, beta, cu, pool, slot + 2, init, SCALE)
    q, k, v, g, beta = make_inputs((2, 3), 90, torch.float32, device)
    slots = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"state_indices must have shape \[N=2\]"):
        recurrent(q, k, v, g, beta, pool, slots[:, None].expand(2, 3), SCALE)
    with pytest.raises(ValueError, match=r"g must have shape \[N=2, Q=3, Hv=4\]"):
        recurrent(q, k, v, g[:, :2], beta, pool, slots, SCALE)
