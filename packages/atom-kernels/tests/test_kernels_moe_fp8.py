"""moe_experts_fp8 (W8A8 block-scaled experts) against a per-token loop in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_kernels.ops.moe import TICKET_COLUMNS, TICKET_TOKENS, experts_fp8_tickets, local_expert_ids
from atom_kernels.testing import assert_close, randn

E4M3 = torch.float8_e4m3fn
# (what, dtype) -> (atol, rtol) against the float64 per-token loop (same e4m3 rounding of the inputs).
# Measured max abs error in the comments (reference on CPU; triton on the H200: see docs/performance.md).
TOL = {
    ("moe_fp8", torch.float32): (1e-5, 1e-5),  # measured 3.4e-07 (|out| ~ 0.6)
    # bf16: GEMM outputs round to bf16 before the activation's quantisation, so a different accumulation
    # order can move one e4m3 step (2^-4 of one element's contribution): measured 1.7e-03 (|out| ~ 0.6)
    ("moe_fp8", torch.bfloat16): (3e-2, 2e-2),
    # triton on the H200: Hopper's e4m3 tensor-core accumulation (less than float32 inside one dot) can move
    # an activation across an e4m3 rounding boundary, one e4m3 step of one element's contribution, in
    # float32 too. Measured over 6 seeds, pair and aligned paths alike: float32 2.0e-02 (T=3 H=384 I=512,
    # |out| ~ 1.05), 1.3e-02 (I=192); bf16 3.2e-02 (I=512), 3.65e-02 (the pair test's I=512 case)
    ("moe_fp8", torch.float32, "triton"): (3e-2, 2e-2),
    ("moe_fp8", torch.bfloat16, "triton"): (5e-2, 2e-2),
}
DTYPES = [torch.float32, torch.bfloat16]


def block_quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (e4m3, ``[ceil(N/bn), ceil(K/bk)]`` scales), per block absmax / 448."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    pad = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).reshape(nb, bn, kb, bk)
    s = pad.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
    q = (pad / s[:, None, :, None]).reshape(nb * bn, kb * bk)[:n, :k]
    return q.to(E4M3), s


def make_experts(num_experts, hidden, inter, block, device, seed=0):
    bn, bk = block
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.05
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.05
    q13, s13, q2, s2 = [], [], [], []
    for e in range(num_experts):
        (gq, gs), (uq, us) = block_quantize(w13[e, :inter], bn, bk), block_quantize(w13[e, inter:], bn, bk)
        q13.append(torch.cat([gq, uq]))
        s13.append(torch.cat([gs, us]))
        dq, ds = block_quantize(w2[e], bn, bk)
        q2.append(dq)
        s2.append(ds)
    return [torch.stack(t).to(device) for t in (q13, s13, q2, s2)]


def qdq64(a: torch.Tensor, group: int) -> torch.Tensor:
    k = a.shape[-1]
    groups = -(-k // group)
    ap = F.pad(a.float(), (0, groups * group - k)).reshape(*a.shape[:-1], groups, group)
    s = ap.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (ap / s).clamp(-448, 448).to(E4M3).double() * s.double()
    return q.reshape(*a.shape[:-1], groups * group)[..., :k]


def deq64(w: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    full = s.double().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
    return w.double() * full


def per_token_loop(x, weights, ids, q13, s13, q2, s2, block):
    bn, bk = block
    x, weights, ids = x.cpu(), weights.cpu(), ids.cpu()
    q13, s13, q2, s2 = q13.cpu(), s13.cpu(), q2.cpu(), s2.cpu()
    inter = q13.shape[1] // 2
    nb = -(-inter // bn)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xq = qdq64(x[t : t + 1], bk)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = xq @ deq64(q13[e, :inter], s13[e, :nb], bn, bk).t()
            up = xq @ deq64(q13[e, inter:], s13[e, nb:], bn, bk).t()
            g, u = gate.to(x.dtype).double(), up.to(x.dtype).double()
            act = (g * torch.sigmoid(g) * u).to(x.dtype)
            y = (qdq64(act, bk) @ deq64(q2[e], s2[e], bn, bk).t()).to(x.dtype).double()
            out[t] += float(weights[t, j]) * y[0]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 64), (7, 64), (40, 192)])
def test_moe_experts_fp8_matches_per_token_loop(impl, tol, device, dtype, tokens, inter):
    fn = impl("moe_experts_fp8", dtype)
    num_experts, hidden, top_k, block = 8, 256, 2, (128, 128)
    q13, s13, q2, s2 = make_experts(num_experts, hidden, inter, block, device)
    x = randn(tokens, hidden, seed=1, dtype=dtype, device=device)
    logits = randn(tokens, num_experts, seed=2, dtype=torch.float32, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    out = fn(x, weights, ids, q13, s13, q2, s2, block)
    assert out.shape == x.shape and out.dtype == dtype
    expected = per_token_loop(x, weights, ids, q13, s13, q2, s2, block)
    assert_close(out, expected, tol("moe_fp8", dtype), f"moe_experts_fp8 {dtype} T={tokens} I={inter}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_moe_experts_fp8_expert_parallel(impl, tol, device, dtype, tokens):
    """Experts split over 2 ranks (4 of 8 each): a rank's call on its experts with ids from
    ``local_expert_ids`` (-1 for the other rank's) == the per-token loop over the slots it holds (a token
    with none gets exactly zero); the two ranks' outputs sum to the call over all 8. 1 and 5 tokens take
    the triton backend's pair path, 40 its aligned path."""
    fn = impl("moe_experts_fp8", dtype)
    num_experts, hidden, inter, top_k, block, ranks = 8, 256, 64, 2, (128, 128), 2
    q13, s13, q2, s2 = make_experts(num_experts, hidden, inter, block, device, seed=3)
    x = randn(tokens, hidden, seed=4, dtype=dtype, device=device)
    logits = randn(tokens, num_experts, seed=5, dtype=torch.float32, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    full = fn(x, weights, ids, q13, s13, q2, s2, block)
    n = num_experts // ranks
    total = torch.zeros(x.shape, dtype=torch.float32, device=device)
    for r in range(ranks):
        lo = r * n
        part = (q13[lo : lo + n], s13[lo : lo + n], q2[lo : lo + n], s2[lo : lo + n])
        tickets = torch.zeros(experts_fp8_tickets(hidden), dtype=torch.int32, device=device)
        out = fn(x, weights, local_expert_ids(ids, lo, n), *part, block, tickets=tickets)
        assert int(tickets.abs().sum()) == 0, "the launch left a ticket set"
        held = ((ids >= lo) & (ids < lo + n)).cpu()
        expected = per_token_loop(x, weights.cpu() * held, ids, q13, s13, q2, s2, block)
        assert_close(out, expected, tol("moe_fp8", dtype), f"rank {r} {dtype} T={tokens}")
        none = ~held.any(1)
        assert torch.equal(out.cpu()[none], torch.zeros_like(out.cpu()[none])), "a token with no local expert"
        total += out.float()
    assert_close(total, full.float(), tol("moe_fp8", dtype), f"sum over ranks {dtype} T={tokens}")


def test_moe_experts_fp8_bad_inputs(impl, device):
    fn = impl("moe_experts_fp8", torch.float32)
    q13, s13, q2, s2 = make_experts(4, 256, 64, (128, 128), device)
    x = torch.zeros(3, 256, device=device)
    w = torch.full((3, 2), 0.5, device=device)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=device)
    with pytest.raises(
        ValueError, match=r"w13_scale must have shape \[E=4, 2\*ceil\(I/bn\)=2, ceil\(H/bk\)=2\]"
    ):
        fn(x, w, ids, q13, s13[:, :1], q2, s2, (128, 128))
    with pytest.raises(ValueError, match="w13 must have dtype float8_e4m3fn"):
        fn(x, w, ids, q13.float(), s13, q2, s2, (128, 128))
    with pytest.raises(ValueError, match="block must be a pair of positive ints"):
        fn(x, w, ids, q13, s13, q2, s2, (128,))
    need = experts_fp8_tickets(256)  # 8 tokens x 256 / 16 columns
    assert need == 128
    bad_tickets = [
        (
            torch.zeros(need - 1, dtype=torch.int32, device=device),
            r"tickets holds 127 counters, needs >= 128",
        ),
        (torch.zeros(need, dtype=torch.int64, device=device), "tickets must have dtype int32"),
        (torch.zeros(need, 2, dtype=torch.int32, device=device), r"tickets must have shape \[C\]"),
        (torch.zeros(2 * need, dtype=torch.int32, device=device)[::2], "tickets must be contiguous"),
        (torch.zeros(need, dtype=torch.int32, device="meta"), "tickets is on meta"),
    ]
    for tickets, msg in bad_tickets:
        with pytest.raises(ValueError, match=msg):
            fn(x, w, ids, q13, s13, q2, s2, (128, 128), tickets=tickets)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter"), [(1, 256, 64), (2, 256, 192), (3, 384, 512), (5, 320, 64)]
)
def test_moe_experts_fp8_pair_path_vs_aligned(device, dtype, tokens, hidden, inter):
    """The pair path (no align, activations quantised in the GEMMs) against the per-token loop, and bit-equal
    to the aligned path, forced both ways at the same tokens; H = 320 and I = 64 leave a partial K group."""
    if device.type != "cuda":
        pytest.skip("the triton FP8 kernels run on a GPU (the CPU interpreter mis-rounds e4m3)")
    from atom_kernels.ops.moe import triton_fp8

    num_experts, top_k, block = 8, 3, (128, 128)
    q13, s13, q2, s2 = make_experts(num_experts, hidden, inter, block, device, seed=3)
    x = randn(tokens, hidden, seed=4, dtype=dtype, device=device)
    logits = randn(tokens, num_experts, seed=5, dtype=torch.float32, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    ids[0, 1] = ids[-1, 0]  # two tokens (or two slots) on one expert
    pairs = triton_fp8.moe_experts_fp8(x, weights, ids, q13, s13, q2, s2, block, config={"PAIRS": True})
    aligned = triton_fp8.moe_experts_fp8(x, weights, ids, q13, s13, q2, s2, block, config={"PAIRS": False})
    expected = per_token_loop(x, weights, ids, q13, s13, q2, s2, block)
    what = f"{dtype} T={tokens} H={hidden} I={inter}"
    tol = TOL[("moe_fp8", dtype, "triton")]
    assert_close(pairs, expected, tol, f"pair path {what}")
    # same operands, scales and per-group products in the same order: bit-equal on the H200
    diff = (pairs.float() - aligned.float()).abs().max().item()
    assert torch.equal(pairs, aligned), f"pair path != aligned path {what} (max |diff| {diff:.3e})"
    again = triton_fp8.moe_experts_fp8(x, weights, ids, q13, s13, q2, s2, block, config={"PAIRS": True})
    assert torch.equal(pairs, again), "pair path is not deterministic"


def pair_module(device: torch.device, dtype: torch.dtype):
    """:mod:`atom_kernels.ops.moe.triton_fp8`, or skip: its kernels run on a GPU, or (fused against unfused
    only: both round e4m3 the interpreter's way) on CPU under ``TRITON_INTERPRET=1`` in float32."""
    from atom_kernels.ops._triton_env import interpreting

    if device.type == "cpu" and not (interpreting() and dtype == torch.float32):
        pytest.skip("the triton FP8 kernels run on a GPU, or on CPU under TRITON_INTERPRET=1 in float32")
    from atom_kernels.ops.moe import triton_fp8

    return triton_fp8


def test_pair_path_tickets_cover_its_launches():
    """The pair path's default launches fit in ``experts_fp8_tickets(H)`` counters at every hidden size."""
    pytest.importorskip("triton", reason="the pair path's constants live in its Triton module")
    from atom_kernels.ops.moe.triton_fp8_decode import PAIR_MAX_TOKENS, PAIR_TILES

    assert PAIR_MAX_TOKENS <= TICKET_TOKENS and PAIR_TILES["PN2"] >= TICKET_COLUMNS
    for hidden in (1, 15, 16, 17, 320, 2048, 2049):
        assert PAIR_MAX_TOKENS * -(-hidden // PAIR_TILES["PN2"]) <= experts_fp8_tickets(hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
def test_moe_experts_fp8_fused_sum_is_bit_equal(device, dtype, tokens):
    """The pair path's second GEMM summing each token's rows itself (ticket per (token, column tile)) gives
    the three-launch result bit for bit, and leaves the caller's tickets zero: a shared pseudo-expert in
    every token's last column (weight 0.7), tokens sharing experts, H = 200 (not a multiple of the 64-column
    tile; partial K groups) and I = 192."""
    fp8 = pair_module(device, dtype)
    num_experts, hidden, inter, top_k, block = 8, 200, 192, 3, (128, 128)
    q13, s13, q2, s2 = make_experts(num_experts + 1, hidden, inter, block, device, seed=6)
    x = randn(tokens, hidden, seed=7, dtype=dtype, device=device)
    logits = randn(tokens, num_experts, seed=8, dtype=torch.float32, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    ids[0, 1] = ids[-1, 0]  # two tokens (or two slots) on one expert
    weights = torch.cat([weights, torch.full((tokens, 1), 0.7, device=device)], 1)
    ids = torch.cat([ids, torch.full((tokens, 1), num_experts, dtype=ids.dtype, device=device)], 1)
    args = (x, weights, ids, q13, s13, q2, s2, block)
    tickets = torch.zeros(experts_fp8_tickets(hidden), dtype=torch.int32, device=device)
    fused = fp8.moe_experts_fp8(*args, tickets=tickets, config={"PAIRS": True})
    assert not tickets.any(), "the fused sum left a ticket non-zero"
    unfused = fp8.moe_experts_fp8(*args, config={"PAIRS": True, "FUSED_SUM": False})
    diff = (fused.float() - unfused.float()).abs().max().item()
    assert torch.equal(fused, unfused), (
        f"fused sum != three launches {dtype} T={tokens} (max |diff| {diff:.3e})"
    )
    again = fp8.moe_experts_fp8(*args, tickets=tickets, config={"PAIRS": True})  # tickets reused
    assert torch.equal(fused, again) and not tickets.any()
    own = fp8.moe_experts_fp8(*args, config={"PAIRS": True})  # tickets allocated by the call
    assert torch.equal(fused, own)
    if device.type == "cuda":
        expected = per_token_loop(*args)
        assert_close(fused, expected, TOL[("moe_fp8", dtype, "triton")], f"fused sum {dtype} T={tokens}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("config", [{"PAIRS": True}, {"PAIRS": True, "FUSED_SUM": False}, {"PAIRS": False}])
def test_moe_experts_fp8_triton_expert_parallel_paths(device, dtype, tokens, config):
    """Each path of the triton FP8 experts (pair path with its fused sum, with the separate sum, aligned)
    on one rank's half of the experts with ids from ``local_expert_ids`` (-1 for the other half) gives
    bit for bit the same path over all experts with the other half's routing weights zeroed (the -1 pairs
    add exactly nothing), and leaves the tickets zero."""
    fp8 = pair_module(device, dtype)
    num_experts, hidden, inter, top_k, block = 8, 200, 192, 3, (128, 128)
    q13, s13, q2, s2 = make_experts(num_experts, hidden, inter, block, device, seed=9)
    x = randn(tokens, hidden, seed=10, dtype=dtype, device=device)
    logits = randn(tokens, num_experts, seed=11, dtype=torch.float32, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    n = num_experts // 2
    for lo in (0, n):
        held = (ids >= lo) & (ids < lo + n)
        part = (q13[lo : lo + n], s13[lo : lo + n], q2[lo : lo + n], s2[lo : lo + n])
        tickets = torch.zeros(experts_fp8_tickets(hidden), dtype=torch.int32, device=device)
        local = local_expert_ids(ids, lo, n)
        out = fp8.moe_experts_fp8(x, weights, local, *part, block, tickets=tickets, config=config)
        assert not tickets.any(), "a launch left a ticket non-zero"
        want = fp8.moe_experts_fp8(x, weights * held, ids, q13, s13, q2, s2, block, config=config)
        diff = (out.float() - want.float()).abs().max().item()
        assert torch.equal(out, want), f"experts [{lo}, {lo + n}) {config} T={tokens}: max |diff| {diff:.3e}"


def test_moe_experts_fp8_forced_pairs_need_enough_tickets(device):
    """Forced onto the pair path past ``TICKET_TOKENS`` tokens, the caller's tickets may be too few for the
    launch: a ValueError naming them, before any launch."""
    fp8 = pair_module(device, torch.float32)
    q13, s13, q2, s2 = make_experts(4, 64, 64, (128, 128), device)
    tokens = TICKET_TOKENS + 1
    x = randn(tokens, 64, seed=1, dtype=torch.float32, device=device)
    w = torch.full((tokens, 2), 0.5, device=device)
    ids = torch.zeros(tokens, 2, dtype=torch.int64, device=device)
    tickets = torch.zeros(experts_fp8_tickets(64), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"tickets holds 32 counters, the pair path needs 36"):
        fp8.moe_experts_fp8(
            x, w, ids, q13, s13, q2, s2, (128, 128), tickets=tickets, config={"PAIRS": True, "PN2": 16}
        )
