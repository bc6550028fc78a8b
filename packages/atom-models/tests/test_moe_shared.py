"""The Qwen3-Next MoE block's shared expert: folded into the routed experts as ``m = Is / I`` pseudo-experts
(bf16/float32 and FP8 block-scaled weights), or a separate gated MLP when ``Is % I != 0``; both against the
HF formula ``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` computed from the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_core import Qwen3NextConfig
from atom_kernels import select_kernels
from atom_models.modules import GatedMLP
from atom_models.moe import Experts, Fp8Experts, SparseMoeBlock, shared_pseudo_experts
from atom_models.testing import tiny_config

# (what) -> (atol, rtol) against the float64 formula; measured max abs error in the comments.
TOL = {
    "float32": (1e-5, 1e-5),  # measured 1.4e-06 (folded), 2.5e-06 (separate)
    # FP8: the folded block against the unfused shared expert (fp8_linear) on the same e4m3 weights, both
    # with activation groups of 128 channels (I = 128): only float32 summation order differs
    "fp8": (1e-6, 1e-6),  # measured 3.0e-08
}


def _config(hidden: int, inter: int, shared: int, experts: int = 4, top_k: int = 2) -> Qwen3NextConfig:
    return tiny_config(
        hidden_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=shared,
    )


@pytest.fixture
def kernels():
    return select_kernels("cpu", torch.float32, backend="reference")


def _hf_formula(x, router, routed, shared, shared_gate, top_k):
    """float64: softmax top-k (renormalised) over ``router``, ``routed`` = (w13 [E, 2I, H], w2 [E, H, I]),
    ``shared`` = (gate [Is, H], up [Is, H], down [H, Is]), ``shared_gate`` [1, H]."""
    x = x.double()
    probs = torch.softmax(x @ router.double().t(), -1)
    w, ids = probs.topk(top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    w13, w2 = (t.double() for t in routed)
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            h = w13[ids[t, j]] @ x[t]
            out[t] += w[t, j] * (w2[ids[t, j]] @ (F.silu(h[:inter]) * h[inter:]))
    g, u, d = (t.double() for t in shared)
    return out + torch.sigmoid(x @ shared_gate.double().t()) * ((F.silu(x @ g.t()) * (x @ u.t())) @ d.t())


def _randomize(block: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def test_shared_expert_folds_into_pseudo_experts(kernels):
    """Is = I: one pseudo-expert after the routed ones, the router one Linear H -> E + 1 rounded up to 8
    rows (random values in the rows past E + 1: only row E may be read); the output is the HF formula with
    the shared expert's gate / up rows and down columns those of the pseudo-expert."""
    cfg = _config(hidden=32, inter=16, shared=16)
    assert shared_pseudo_experts(cfg) == 1
    block = SparseMoeBlock(cfg, kernels, dtype=torch.float32)
    assert block.shared_expert is None and block.shared_expert_gate is None
    assert block.gate.weight.shape == (8, 32) and block.experts.w13.shape == (5, 32, 32)
    _randomize(block, 0)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(1))
    e, i = 4, 16
    w13, w2 = block.experts.w13, block.experts.w2
    shared = (
        w13[e, :i],
        w13[e, i:],
        w2[e],
    )
    want = _hf_formula(x, block.gate.weight[:e], (w13[:e], w2[:e]), shared, block.gate.weight[e : e + 1], 2)
    with torch.no_grad():
        got = block(x)
    torch.testing.assert_close(got.double(), want, atol=TOL["float32"][0], rtol=TOL["float32"][1])


def test_shared_expert_stays_separate_when_sizes_do_not_divide(kernels):
    """Is != I (24, and 32 = 2 I): a separate GatedMLP and shared_expert_gate, router H -> E."""
    assert shared_pseudo_experts(_config(hidden=32, inter=16, shared=32)) == 0
    cfg = _config(hidden=32, inter=16, shared=24)
    assert shared_pseudo_experts(cfg) == 0
    block = SparseMoeBlock(cfg, kernels, dtype=torch.float32)
    assert isinstance(block.shared_expert, GatedMLP) and block.shared_expert_gate is not None
    assert block.gate.weight.shape == (4, 32) and block.experts.w13.shape == (4, 32, 32)
    _randomize(block, 2)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(3))
    gu = block.shared_expert.gate_up_proj.weight
    shared = (gu[:24], gu[24:], block.shared_expert.down_proj.weight)
    routed = (block.experts.w13, block.experts.w2)
    want = _hf_formula(x, block.gate.weight, routed, shared, block.shared_expert_gate.weight, 2)
    with torch.no_grad():
        got = block(x)
    torch.testing.assert_close(got.double(), want, atol=TOL["float32"][0], rtol=TOL["float32"][1])


def test_no_shared_expert(kernels):
    cfg = _config(hidden=32, inter=16, shared=0)
    block = SparseMoeBlock(cfg, kernels, dtype=torch.float32)
    assert block.num_shared == 0 and block.shared_expert is None and block.gate.weight.shape == (4, 32)
    assert isinstance(block.experts, Experts) and block.experts.w13.shape[0] == 4


def test_fp8_folded_shared_expert_equals_the_unfused_one(kernels):
    """FP8 block-scaled weights, I = Is = 128 (one pseudo-expert): the folded block equals routed experts
    plus ``sigmoid(gate) * fp8_linear`` shared expert with the pseudo-expert's weights and [128, 128] scales."""
    h, i, e, k = 256, 128, 4, 2
    cfg = _config(hidden=h, inter=i, shared=i, experts=e, top_k=k)
    block = SparseMoeBlock(cfg, kernels, dtype=torch.float32)
    block.experts = Fp8Experts(e, h, i, (128, 128), num_shared=1)
    gen = torch.Generator().manual_seed(4)
    ex = block.experts
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=gen) * 0.1)
        for w in (ex.w13, ex.w2):
            w.copy_((torch.randn(w.shape, generator=gen) * 0.5).to(torch.float8_e4m3fn))
        for s in (ex.w13_scale_inv, ex.w2_scale_inv):
            s.copy_(torch.rand(s.shape, generator=gen) * 0.1 + 0.02)
    x = torch.randn(9, h, generator=gen)
    with torch.no_grad():
        got = block(x)
        logits = block.gate(x)
        weights, ids = kernels.moe_router(logits[:, :e], k, True)
        routed = kernels.moe_experts_fp8(
            x, weights, ids, ex.w13[:e], ex.w13_scale_inv[:e], ex.w2[:e], ex.w2_scale_inv[:e], (128, 128)
        )
        nb = ex.w13_scale_inv.shape[1] // 2  # scale rows of one half (gate or up)
        gu = torch.cat([ex.w13[e + j, :i] for j in range(1)] + [ex.w13[e + j, i:] for j in range(1)])
        gu_s = torch.cat(
            [ex.w13_scale_inv[e + j, :nb] for j in range(1)]
            + [ex.w13_scale_inv[e + j, nb:] for j in range(1)]
        )
        down = torch.cat([ex.w2[e + j] for j in range(1)], dim=1)
        down_s = torch.cat([ex.w2_scale_inv[e + j] for j in range(1)], dim=1)
        act = kernels.silu_and_mul(kernels.fp8_linear(x, gu, gu_s, (128, 128), None))
        shared = kernels.fp8_linear(act, down, down_s, (128, 128), None)
        want = routed + torch.sigmoid(logits[:, e : e + 1]) * shared
    torch.testing.assert_close(got, want, atol=TOL["fp8"][0], rtol=TOL["fp8"][1])


@pytest.mark.parametrize("tokens", [3, 200])
def test_hold_float32_experts_bit_equal(tokens):
    """bf16 block on the reference kernels: float32 copies of the experts' weights made once
    (``hold_float32_experts``) give the bit-identical output, add 2 bytes a weight, and are held only where
    the bound ``moe_experts`` backend prefers them (a second call adds nothing; the cpu backend only
    where its C pass cannot multiply bf16 weights itself)."""
    from atom_kernels.ops.moe import prefers_float32_weights
    from atom_models import hold_float32_experts

    cfg = _config(hidden=64, inter=16, shared=32, experts=8, top_k=2)
    ref = select_kernels("cpu", torch.bfloat16, backend="reference")
    block = SparseMoeBlock(cfg, ref, dtype=torch.bfloat16)
    _randomize(block, 5)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    with torch.no_grad():
        before = block(x)
        n = block.experts.w13.numel() + block.experts.w2.numel()
        assert hold_float32_experts(block, ref) == 2 * n
        assert block.experts.w13.dtype == block.experts.w2.dtype == torch.float32
        assert hold_float32_experts(block, ref) == 0
        assert torch.equal(block(x), before)
    other = dict(ref.backends, moe_experts="triton")  # a backend without float32 weights: left as they are
    fresh = SparseMoeBlock(cfg, ref, dtype=torch.bfloat16)
    assert hold_float32_experts(fresh, type("K", (), {"backends": other})()) == 0
    assert fresh.experts.w13.dtype == torch.bfloat16
    cpu = select_kernels("cpu", torch.bfloat16)
    on_cpu = SparseMoeBlock(cfg, cpu, dtype=torch.bfloat16)
    held = hold_float32_experts(on_cpu, cpu)
    assert held == (2 * n if prefers_float32_weights("cpu") else 0)
