"""moe_router and moe_experts against naive per-token loops in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_kernels.ops.moe import local_expert_ids
from atom_kernels.testing import assert_close, gen, randn

# (op, dtype) -> (atol, rtol) against the float64 per-token loop. Measured max abs error in comments.
TOL = {
    ("moe_router", torch.float32): (1e-6, 1e-5),  # measured 7.1e-08
    ("moe_router", torch.bfloat16): (1e-6, 1e-5),  # measured 8.8e-08 (softmax of the bf16 logits in fp32)
    ("router_sum", torch.float32): (1e-6, 0.0),  # measured 1.2e-07: renormalised weights sum to 1
    ("router_sum", torch.bfloat16): (
        8e-3,
        0.0,
    ),  # 4 weights rounded to bf16 (<= 2^-9 each): sum within 4 * 2^-9
    ("moe_experts", torch.float32): (1e-5, 1e-5),  # measured 5.1e-07; 2.2e-05 at |out| ~ 90 (rel 2.5e-07)
    ("moe_experts", torch.bfloat16): (3e-2, 2e-2),  # measured 8.9e-03 (rel 6.1e-03, |out| ~ 1.5)
    # the cpu backend's torch forms against the reference's per-expert loop, both bf16: one bf16 ulp.
    # Measured: bit-equal on an AMX Xeon; on an AVX2-only AMD EPYC (Zen 3) 1 element of 8192 at T = 32
    # differs by 1.2e-07 (one ulp), the dense matmul's sums running in another order there
    ("cpu_forms", torch.bfloat16): (0.0, 2**-7),
}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", [7, 63])
def test_moe_router(impl, tol, device, dtype, renormalize, num_tokens):
    """7 and 63 tokens: the triton backend's program per token below and from its size threshold."""
    fn = impl("moe_router", dtype)
    logits = randn(num_tokens, 32, seed=1, dtype=dtype, device=device, scale=2.0)
    weights, ids = fn(logits, 4, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and weights.shape == (num_tokens, 4)
    probs = torch.softmax(logits.double().cpu(), -1)
    # bf16 logits hold exact ties, and topk orders tied entries arbitrarily: check that the chosen
    # experts carry the top-k probabilities (as a multiset), and that the weights are theirs.
    top_vals = probs.topk(4, dim=-1).values
    chosen = probs.gather(-1, ids.cpu())
    assert all(len(set(r.tolist())) == 4 for r in ids.cpu()), "moe_router picked an expert twice"
    assert torch.equal(chosen.sort(-1, descending=True).values, top_vals), (
        "moe_router picked experts that are not the softmax top-k"
    )
    expected_w = chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen
    # the weights come rounded to the logits' dtype (stock vLLM's router)
    expected_w = expected_w.to(dtype).double()
    if renormalize:
        assert_close(
            weights.sum(-1),
            torch.ones(num_tokens, dtype=torch.float64),
            tol("router_sum", dtype),
            "renormalised sum",
        )
    assert_close(weights, expected_w, tol("moe_router", dtype), f"moe_router {dtype}")


def test_moe_router_non_finite_logits(impl, device):
    """NaN / +inf logits (a NaN row) and rows with fewer than top_k nonzero probabilities still give
    top_k distinct ids in [0, E): the ids index the experts' tables. E = 12 is not a power of two, so
    the triton kernel has padding lanes that must never be picked."""
    fn = impl("moe_router", torch.float32)
    num_experts, top_k = 12, 4
    logits = randn(6, num_experts, seed=3, dtype=torch.float32, device=device, scale=2.0)
    logits[1, 5] = float("nan")
    logits[2] = float("nan")
    logits[3, 7] = float("inf")
    logits[4, 2:] = float("-inf")  # two finite logits: the other experts have probability exactly 0
    logits[5] = float("-inf")
    for renormalize in (True, False):
        weights, ids = fn(logits, top_k, renormalize)
        ids_cpu = ids.cpu()
        assert int(ids_cpu.min()) >= 0 and int(ids_cpu.max()) < num_experts, f"ids out of range: {ids_cpu}"
        assert all(len(set(r.tolist())) == top_k for r in ids_cpu), f"an expert picked twice: {ids_cpu}"
        for row in (1, 2, 3, 5):
            assert bool(weights[row].isnan().all()), f"row {row}: NaN logits must give NaN weights"
        probs = torch.softmax(logits[[0, 4]].double().cpu(), -1)
        chosen = probs.gather(-1, ids_cpu[[0, 4]])
        assert torch.equal(chosen.sort(-1, descending=True).values, probs.topk(top_k, dim=-1).values)
        assert set(ids_cpu[4, :2].tolist()) == {0, 1}, "row 4: the two finite logits first"
        expected = chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen
        assert_close(weights[[0, 4]], expected, (1e-6, 1e-5), "finite rows")


@pytest.mark.parametrize("num_shared", [1, 2])
def test_moe_router_shared_columns(impl, tol, device, num_shared):
    """``num_shared = m``: routing over the first E columns exactly as without them, then m columns with
    ids E + j and weight sigmoid(logits[:, E]). E = 12 (not a power of two), row 1 with a NaN routed logit
    keeps a finite shared weight, row 2 with a NaN shared logit keeps its routed weights. The logits are a
    row-strided view of 16-column rows (as the model's aligned router gives them), NaN past column E."""
    fn = impl("moe_router", torch.float32)
    num_experts, top_k = 12, 4
    wide = randn(7, 16, seed=9, dtype=torch.float32, device=device, scale=2.0)
    wide[:, num_experts + 1 :] = float("nan")
    logits = wide[:, : num_experts + 1]
    logits[1, 3] = float("nan")
    logits[2, num_experts] = float("nan")
    weights, ids = fn(logits, top_k, True, num_shared=num_shared)
    routed_w, routed_ids = fn(logits[:, :num_experts].contiguous(), top_k, True)
    assert weights.shape == ids.shape == (7, top_k + num_shared)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids[:, :top_k].cpu(), routed_ids.cpu()), "routed ids differ from the router alone"
    assert_close(
        weights[[0, 2, 3, 4, 5, 6], :top_k], routed_w[[0, 2, 3, 4, 5, 6]], (0.0, 0.0), "routed weights"
    )
    assert bool(weights[1, :top_k].isnan().all()), "row 1: a NaN routed logit gives NaN routed weights"
    want_ids = torch.arange(num_experts, num_experts + num_shared).expand(7, -1)
    assert torch.equal(ids[:, top_k:].cpu(), want_ids), f"shared ids: {ids[:, top_k:]}"
    gate = torch.sigmoid(logits[:, num_experts].double().cpu())[:, None].expand(-1, num_shared)
    rows = [0, 1, 3, 4, 5, 6]
    assert_close(weights[rows, top_k:], gate[rows], tol("moe_router", torch.float32), "shared weights")
    assert bool(weights[2, top_k:].isnan().all()), "row 2: a NaN shared logit gives NaN shared weights"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_shared", [0, 1])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 11])
def test_moe_gate_router(impl, tol, device, dtype, num_shared, num_tokens):
    """``moe_gate_router`` is the router's Linear then ``moe_router``: against the float64 softmax of
    ``x @ w.T``. E = 60 (not a power of two); the weight has 64 rows, NaN past the columns the router
    reads (padding that must never reach the result); 1-2 tokens take the triton backend's fused launch,
    more the Linear + router path; the caller's counter is left zero."""
    fn = impl("moe_gate_router", dtype)
    num_experts, top_k, hidden = 60, 4, 200
    cols = num_experts + (1 if num_shared else 0)
    x = randn(num_tokens, hidden, seed=4, dtype=dtype, device=device)
    w = randn(64, hidden, seed=5, dtype=dtype, device=device, scale=0.3)
    w[cols:] = float("nan")
    tickets = torch.zeros(1, dtype=torch.int32, device=device)
    weights, ids = fn(x, w, num_experts, top_k, True, num_shared, tickets=tickets)
    assert weights.shape == ids.shape == (num_tokens, top_k + num_shared)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert int(tickets.abs().sum()) == 0, f"tickets not left zero: {tickets.tolist()}"
    logits = x.double().cpu() @ w[:cols].double().cpu().T
    probs = torch.softmax(logits[:, :num_experts], -1)
    ids_cpu = ids.cpu()
    assert all(len(set(r.tolist())) == top_k for r in ids_cpu[:, :top_k]), "an expert picked twice"
    chosen = probs.gather(-1, ids_cpu[:, :top_k])
    # bf16: the logits are rounded to bf16 (as a Linear's output) before the softmax, so a near tie may
    # pick the other expert: the chosen probabilities must be the top-k ones up to that rounding
    top_tol = (0.0, 0.0) if dtype == torch.float32 else (2e-3, 2e-2)  # measured: exact / 6.1e-04
    assert_close(chosen.sort(-1, descending=True).values, probs.topk(top_k, -1).values, top_tol, "top-k")
    expected = chosen / chosen.sum(-1, keepdim=True)
    w_tol = tol("moe_router", dtype) if dtype == torch.float32 else (5e-3, 2e-2)  # measured 1.4e-03
    assert_close(weights[:, :top_k], expected, w_tol, f"moe_gate_router weights {dtype}")
    if num_shared:
        assert torch.equal(ids_cpu[:, top_k:], torch.full((num_tokens, 1), num_experts))
        gate = torch.sigmoid(logits[:, num_experts:])
        assert_close(weights[:, top_k:], gate, w_tol, "shared weight")
    same = impl("moe_router", dtype)(F.linear(x, w)[:, :cols], top_k, True, num_shared)
    if dtype == torch.float32:  # the Linear + router path: the same experts
        assert torch.equal(ids.cpu(), same[1].cpu()), (
            "moe_gate_router picks other experts than Linear + router"
        )


def test_moe_gate_router_nan_token(impl, tol, device):
    """A token whose hidden state holds a NaN: NaN routed weights, still ``top_k`` distinct ids in [0, E)
    (they index the experts' tables); the other tokens route as without it."""
    fn = impl("moe_gate_router", torch.float32)
    num_experts, top_k = 12, 4
    x = randn(2, 64, seed=6, dtype=torch.float32, device=device)
    w = randn(16, 64, seed=7, dtype=torch.float32, device=device, scale=0.3)
    x[1, 5] = float("nan")
    weights, ids = fn(x, w, num_experts, top_k, True, 1)
    ids_cpu = ids.cpu()
    assert int(ids_cpu[:, :top_k].min()) >= 0 and int(ids_cpu[:, :top_k].max()) < num_experts, ids_cpu
    assert all(len(set(r.tolist())) == top_k for r in ids_cpu[:, :top_k]), (
        f"an expert picked twice: {ids_cpu}"
    )
    assert bool(weights[1].isnan().all()), f"NaN token: weights {weights[1]}"
    clean_w, clean_ids = fn(x[:1], w, num_experts, top_k, True, 1)
    assert torch.equal(ids[:1].cpu(), clean_ids.cpu()), "the NaN token changed another token's experts"
    # CPU GEMMs round differently with another row count: float32 noise only
    assert_close(weights[:1], clean_w, tol("moe_router", torch.float32), "the other token's weights")


@pytest.mark.parametrize(
    ("num_experts", "top_k", "num_shared"), [(12, 4, 1), (60, 10, 0), (60, 10, 1), (100, 10, 1), (512, 10, 1)]
)
@pytest.mark.parametrize("num_tokens", [1, 2])
@pytest.mark.parametrize("nan_token", [False, True])
def test_moe_gate_router_ranks_as_router(impl, device, num_experts, top_k, num_shared, num_tokens, nan_token):
    """The fused launch ranks exactly as ``moe_router`` on the same logits: the same ids, weights bit for
    bit. Token t's hidden state is the unit vector e_t, so its logits are exactly column t of the weight
    (float32: one product by 1, the others by 0). Column 0: multiples of 0.5 (exact ties, also across the
    top_k boundary) and neighbouring float32 values around 0.01 (distinct logits, equal probabilities);
    column 1: three logits near 0 and -1e30 elsewhere (fewer than top_k nonzero probabilities: ties at 0).
    ``nan_token``: the last token's hidden state holds a NaN (a NaN row: NaN weights, distinct ids)."""
    fn = impl("moe_gate_router", torch.float32)
    router = impl("moe_router", torch.float32)
    cols = num_experts + (1 if num_shared else 0)
    hidden = 16
    gen = torch.Generator().manual_seed(num_experts + top_k)
    w = torch.full((cols + 3, hidden), float("nan"))  # rows past the router's columns: never read
    w[:cols] = torch.randn(cols, hidden, generator=gen)
    w[:cols, 0] = torch.randint(-3, 4, (cols,), generator=gen).float() * 0.5
    near = torch.arange(min(8, num_experts))
    w[near * 5 % num_experts, 0] = (
        torch.nextafter(torch.full((len(near),), 0.01), torch.tensor(1.0)) + near * 1e-9
    )
    w[:cols, 1] = -1e30
    w[[1, num_experts // 2, num_experts - 1], 1] = torch.tensor([0.0, 0.25, 0.0])
    x = torch.zeros(num_tokens, hidden)
    x[torch.arange(num_tokens), torch.arange(num_tokens)] = 1.0
    if nan_token:
        x[-1, hidden - 1] = float("nan")
    logits = torch.where(x.isnan().any(1, keepdim=True), float("nan"), w[:cols, :num_tokens].T)
    x, w, logits = x.to(device), w.to(device), logits.contiguous().to(device)
    weights, ids = fn(x, w, num_experts, top_k, True, num_shared)
    want_w, want_ids = router(logits, top_k, True, num_shared)
    assert torch.equal(ids.cpu(), want_ids.cpu()), f"ids {ids.tolist()} != moe_router's {want_ids.tolist()}"
    torch.testing.assert_close(weights, want_w, rtol=0.0, atol=0.0, equal_nan=True)
    nan_rows = weights[:, :top_k].isnan().all(1).tolist()
    assert nan_rows == [nan_token and t == num_tokens - 1 for t in range(num_tokens)], f"NaN rows {nan_rows}"


def test_moe_gate_router_bad_inputs(impl, device):
    fn = impl("moe_gate_router", torch.float32)
    x, w = torch.randn(2, 16, device=device), torch.randn(8, 16, device=device)
    with pytest.raises(
        ValueError, match=r"gate_weight has 8 rows, needs >= 9 \(E = 8 routed \+ the shared gate\)"
    ):
        fn(x, w, 8, 2, True, 1)
    with pytest.raises(ValueError, match=r"gate_weight must have dtype"):
        fn(x, w.double(), 8, 2, True, 0)
    with pytest.raises(ValueError, match=r"top_k must be <= E=8, got 9"):
        fn(x, w, 8, 9, True, 0)
    with pytest.raises(ValueError, match=r"tickets must have dtype int32"):
        fn(x, w, 8, 2, True, 0, tickets=torch.zeros(1, dtype=torch.int64, device=device))


def test_moe_router_shared_bad_inputs(impl, device):
    router = impl("moe_router", torch.float32)
    with pytest.raises(ValueError, match=r"num_shared must be an int >= 0, got -1"):
        router(torch.randn(3, 5, device=device), 2, True, num_shared=-1)
    with pytest.raises(ValueError, match=r"top_k must be <= E=4, got 5"):
        router(torch.randn(3, 5, device=device), 5, True, num_shared=1)
    with pytest.raises(ValueError, match=r"logits must have shape \[T, E \+ 1\], got \(3,\)"):
        router(torch.randn(3, device=device), 1, True, num_shared=1)


def naive_moe(x, weights, ids, w13, w2):
    x, weights, w13, w2 = (t.double().cpu() for t in (x, weights, w13, w2))
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 65])
def test_moe_experts_matches_per_token_loop(impl, tol, device, dtype, tokens):
    router, experts = impl("moe_router", dtype), impl("moe_experts", dtype)
    num_experts, hidden, inter, top_k = 16, 64, 32, 4
    x = randn(tokens, hidden, seed=2, dtype=dtype, device=device)
    w13 = randn(num_experts, 2 * inter, hidden, seed=3, dtype=dtype, device=device, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, seed=4, dtype=dtype, device=device, scale=inter**-0.5)
    logits = randn(tokens, num_experts, seed=5, dtype=dtype, device=device)
    weights, ids = router(logits, top_k, True)
    out = experts(x, weights, ids, w13, w2)
    assert out.dtype == dtype and out.shape == x.shape
    expected = naive_moe(x, weights, ids.cpu(), w13, w2)
    assert_close(out, expected, tol("moe_experts", dtype), f"moe_experts {dtype} T={tokens}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 65, 600])
def test_moe_experts_with_shared_pseudo_experts(impl, tol, device, dtype, tokens):
    """The model's folded shared expert: ``moe_router(..., num_shared=2)`` routes every token to experts
    E and E + 1 as well (K = top_k + 2 columns), one ``moe_experts`` call over E + 2 stacked experts.
    T = 600 pads each routed expert to T in a batched form: the cpu backend's sorted per-expert loop."""
    router, experts = impl("moe_router", dtype), impl("moe_experts", dtype)
    num_experts, m, hidden, inter, top_k = 16, 2, 64, 32, 4
    x = randn(tokens, hidden, seed=12, dtype=dtype, device=device)
    w13 = randn(num_experts + m, 2 * inter, hidden, seed=13, dtype=dtype, device=device, scale=hidden**-0.5)
    w2 = randn(num_experts + m, hidden, inter, seed=14, dtype=dtype, device=device, scale=inter**-0.5)
    logits = randn(tokens, num_experts + 1, seed=15, dtype=dtype, device=device)
    weights, ids = router(logits, top_k, True, num_shared=m)
    assert ids.shape == (tokens, top_k + m)
    out = experts(x, weights, ids, w13, w2)
    expected = naive_moe(x, weights, ids.cpu(), w13, w2)
    assert_close(out, expected, tol("moe_experts", dtype), f"moe_experts + shared {dtype} T={tokens}")


def test_local_expert_ids(device):
    """Global ids -> one rank's: ``id - first`` inside ``[first, first + count)``, -1 elsewhere, same dtype."""
    ids = torch.tensor([[0, 3, 4], [7, 5, 2]], device=device)
    for dtype in (torch.int64, torch.int32):
        got = local_expert_ids(ids.to(dtype), 3, 3)
        assert got.dtype == dtype
        assert got.cpu().tolist() == [[-1, 0, 1], [-1, 2, -1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 65])
def test_moe_experts_expert_parallel(impl, tol, device, dtype, tokens):
    """Experts split over 2 ranks (8 of 16 each): a rank's call on its 8 experts with its ids
    (``local_expert_ids``, -1 for the other rank's) == the per-token loop over the slots it holds (a token
    with none gets exactly zero); the two ranks' outputs sum to the call over all 16."""
    router, experts = impl("moe_router", dtype), impl("moe_experts", dtype)
    num_experts, hidden, inter, top_k, ranks = 16, 64, 32, 4, 2
    x = randn(tokens, hidden, seed=22, dtype=dtype, device=device)
    w13 = randn(num_experts, 2 * inter, hidden, seed=23, dtype=dtype, device=device, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, seed=24, dtype=dtype, device=device, scale=inter**-0.5)
    logits = randn(tokens, num_experts, seed=25, dtype=dtype, device=device)
    weights, ids = router(logits, top_k, True)
    full = experts(x, weights, ids, w13, w2)
    n = num_experts // ranks
    total = torch.zeros(x.shape, dtype=torch.float32, device=device)
    for r in range(ranks):
        lo = r * n
        local = local_expert_ids(ids, lo, n)
        out = experts(x, weights, local, w13[lo : lo + n], w2[lo : lo + n])
        assert out.dtype == dtype and out.shape == x.shape
        held = ((ids >= lo) & (ids < lo + n)).cpu()
        expected = naive_moe(x, weights.cpu() * held, ids.cpu(), w13, w2)
        assert_close(out, expected, tol("moe_experts", dtype), f"rank {r} of {ranks} {dtype} T={tokens}")
        none = ~held.any(1)
        assert torch.equal(out.cpu()[none], torch.zeros_like(out.cpu()[none])), "a token with no local expert"
        total += out.float()
    assert_close(total, full.float(), tol("moe_experts", dtype), f"sum over ranks {dtype} T={tokens}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_busy_expert_and_unheld_slots(impl, tol, device, dtype):
    """One expert in every token's row (as a folded shared expert) and -1 ids (slots held elsewhere) in
    half the rows of another column: padding every expert to the busy one's count would triple the rows,
    which sends the cpu backend to its sorted per-expert loop; == the per-token loop over the held slots."""
    experts = impl("moe_experts", dtype)
    tokens, num_experts, hidden, inter = 300, 4, 64, 32
    x = randn(tokens, hidden, seed=32, dtype=dtype, device=device)
    w13 = randn(num_experts, 2 * inter, hidden, seed=33, dtype=dtype, device=device, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, seed=34, dtype=dtype, device=device, scale=inter**-0.5)
    routed = torch.randint(0, num_experts, (tokens, 2), generator=gen(35))
    routed[::2, 1] = -1
    ids = torch.cat([torch.zeros(tokens, 1, dtype=torch.long), routed], 1)
    weights = torch.rand(tokens, 3, generator=gen(36))
    out = experts(x, weights.to(device), ids.to(device), w13, w2)
    held = ids >= 0
    expected = naive_moe(x, weights * held, ids.clamp(min=0), w13, w2)
    assert_close(out, expected, tol("moe_experts", dtype), f"busy expert + unheld slots {dtype}")


def test_moe_experts_int32_ids_and_unused_experts(impl, tol, device):
    """Only some experts receive tokens; int32 ids give the same result as int64."""
    experts = impl("moe_experts", torch.float32)
    x = randn(5, 16, seed=6, dtype=torch.float32, device=device)
    w13 = randn(8, 16, 16, seed=7, dtype=torch.float32, device=device)
    w2 = randn(8, 16, 8, seed=8, dtype=torch.float32, device=device)
    ids = torch.tensor([[3, 5], [5, 3], [3, 3], [7, 5], [5, 7]], device=device)
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(0)).to(device)
    out64 = experts(x, weights, ids, w13, w2)
    out32 = experts(x, weights, ids.int(), w13, w2)
    assert_close(out32, out64, tol("moe_experts", torch.float32), "int32 vs int64 ids")  # 0 (reference)
    assert_close(
        out64, naive_moe(x, weights, ids.cpu(), w13, w2), tol("moe_experts", torch.float32), "sparse"
    )


def test_bad_inputs(impl, device):
    router, experts = impl("moe_router", torch.float32), impl("moe_experts", torch.float32)
    with pytest.raises(ValueError, match="top_k must be <= E=4"):
        router(torch.randn(3, 4, device=device), 5, True)
    x = torch.randn(3, 16, device=device)
    w13, w2 = torch.randn(4, 8, 16, device=device), torch.randn(4, 16, 4, device=device)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=device)
    weights = torch.ones(3, 2, device=device)
    with pytest.raises(ValueError, match=r"w2 must have shape \[E=4, H=16, I=4\], got \(4, 16, 5\)"):
        experts(x, weights, ids, w13, torch.randn(4, 16, 5, device=device))
    with pytest.raises(ValueError, match=r"ids must have shape \[T=3, K=2\]"):
        experts(x, weights, ids[:, :1], w13, w2)
    with pytest.raises(ValueError, match="ids must have dtype int64 or int32"):
        experts(x, weights, ids.float(), w13, w2)
    with pytest.raises(ValueError, match="w13 must have dtype bfloat16"):
        experts(x.bfloat16(), weights, ids, w13.half(), w2.half())
    with pytest.raises(ValueError, match="w2 must have dtype float32"):
        experts(x, weights, ids, w13, w2.bfloat16())
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"ids must lie in \[-1, E=4\)"):
            experts(x, weights, ids + 4, w13, w2)
        with pytest.raises(ValueError, match=r"ids must lie in \[-1, E=4\)"):
            experts(x, weights, ids - 2, w13, w2)


@pytest.mark.parametrize("tokens", [1, 2, 32, 96, 512])
def test_moe_experts_cpu_forms_match_reference(tokens):
    """The cpu backend's torch forms (dense at T = 1..96 here, the sorted loop at 512) at the bundled model's
    shapes (8 routed experts top-2 + 2 shared pseudo-experts, H = 256, I = 64), bf16: the reference's
    per-expert loop to one bf16 ulp (``TOL``; bit-equal where the CPU's bf16 matmul sums in the same order),
    with the weights as bf16 or as float32 copies held by the caller. (In
    float32 the dense form's one ``[T, H] x [H, E * 2I]`` matmul sums some outputs in another order than
    the per-expert matmuls at T = 2 and 32: last-bit differences that the activation's bf16 rounding hides
    here.)"""
    from atom_kernels.ops.moe import cpu, reference

    num_experts, m, hidden, inter, top_k = 8, 2, 256, 64, 2
    dt, cpu_dev = torch.bfloat16, torch.device("cpu")
    x = randn(tokens, hidden, seed=42, dtype=dt, device=cpu_dev)
    w13 = randn(num_experts + m, 2 * inter, hidden, seed=43, dtype=dt, device=cpu_dev, scale=hidden**-0.5)
    w2 = randn(num_experts + m, hidden, inter, seed=44, dtype=dt, device=cpu_dev, scale=inter**-0.5)
    logits = randn(tokens, num_experts + 1, seed=45, dtype=dt, device=cpu_dev)
    weights, ids = reference.moe_router(logits, top_k, True, num_shared=m)
    ids[::3, 1] = -1  # slots held elsewhere contribute zero in every form
    expected = reference.moe_experts(x, weights, ids, w13, w2)
    tol = TOL["cpu_forms", dt]
    assert_close(cpu.torch_forms(x, weights, ids, w13, w2), expected, tol, f"bf16 weights, T={tokens}")
    assert_close(
        cpu.torch_forms(x, weights, ids, w13.float(), w2.float()), expected, tol, f"fp32 copies, T={tokens}"
    )


def test_moe_experts_cpu_dense_form_only_for_few_experts_a_slot(monkeypatch):
    """The cpu backend's torch forms run every expert on every token only where that is within ``MAX_PADDING`` times the
    routed work: 64 experts top-2 at T = 4 take another form (same result as the reference)."""
    from atom_kernels.ops.moe import cpu, reference

    cpu_dev = torch.device("cpu")
    x = randn(4, 32, seed=50, dtype=torch.float32, device=cpu_dev)
    ids = torch.tensor([[0, 63], [5, 9], [9, 5], [17, 40]])
    weights = torch.rand(4, 2, generator=gen(51))
    calls = []
    monkeypatch.setattr(cpu, "_dense", lambda *a: calls.append(1) or reference.moe_experts(*a))
    for num_experts in (64, 4 * 2):  # 64 > MAX_PADDING * K = 8: not dense; 8 experts: dense
        w13 = randn(num_experts, 16, 32, seed=52, dtype=torch.float32, device=cpu_dev)
        w2 = randn(num_experts, 32, 8, seed=53, dtype=torch.float32, device=cpu_dev)
        got = cpu.torch_forms(x, weights, ids % num_experts, w13, w2)
        torch.testing.assert_close(got, reference.moe_experts(x, weights, ids % num_experts, w13, w2))
    assert calls == [1]
