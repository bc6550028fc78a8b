"""Expert parallelism at TP = 2 on CPU: the layout, each rank holding and reading only its half of the
routed experts (whole, equal to TP = 1's), and the standalone engine on 2 gloo ranks with
``EngineConfig(expert_parallel=True)`` reproducing the float32 greedy reference (which TP = 1 reproduces)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import time
from pathlib import Path

import pytest
import torch
from _helpers import MIN_ACCEPTANCE, greedy_mismatch
from atom_core import ConfigError, Qwen3NextConfig
from atom_kernels import select_kernels
from atom_models import DenseCoreFactory, Qwen3NextForCausalLM, Qwen3NextMTP, load_mtp, load_target
from atom_models import loader as loader_mod
from atom_models.engine import EngineConfig, SamplingParams
from atom_models.engine.tp_launch import TPRun, generate_tp
from atom_models.moe import Fp8Experts, SparseMoeBlock, shared_pseudo_experts
from atom_models.parallel import RankWithoutGroup, TPLayout
from atom_models.testing import tiny_config

TP = 2
KS = (0, 1, 3)
ENGINE = dict(max_model_len=256, max_num_seqs=8)
EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")
# (atol, rtol): the ranks' summed MoE outputs against the folded block's, float32 (summation order only):
# measured 9.5e-07
TOL = (1e-5, 1e-5)


def test_layout_partitions_the_experts(model_dir):
    cfg = Qwen3NextConfig.from_hf(model_dir)
    n = cfg.num_experts // TP
    for r in range(TP):
        split = TPLayout.from_config(cfg, r, TP)
        ep = TPLayout.from_config(cfg, r, TP, expert_parallel=True)
        assert (split.num_local_experts, split.expert_start, split.expert_parallel) == (
            cfg.num_experts,
            0,
            False,
        )
        assert (ep.num_local_experts, ep.expert_start, ep.expert_parallel) == (n, r * n, True)
        assert split.moe_intermediate_size * TP == ep.moe_intermediate_size == cfg.moe_intermediate_size
        # everything but the routed experts is laid out as without expert parallelism
        same = (
            "num_heads",
            "num_kv_heads",
            "linear_num_key_heads",
            "shared_expert_intermediate_size",
            "vocab_size",
        )
        assert all(getattr(ep, f) == getattr(split, f) for f in same)
    odd = dataclasses.replace(cfg, num_experts=cfg.num_experts + 1)
    with pytest.raises(ConfigError, match="num_experts"):
        TPLayout.from_config(odd, 0, TP, expert_parallel=True)


@dataclasses.dataclass(frozen=True)
class PartialRank:
    """Rank ``rank`` of ``world_size`` whose all-reduce returns its own partial sum (the test adds the
    ranks' outputs itself)."""

    rank: int
    world_size: int
    capturable: bool = True

    def all_reduce(self, x):
        return x


def test_folded_shared_expert_config_unfolds_under_expert_parallel():
    """A config whose shared expert is one expert size (Is = I: folded into a pseudo-expert at TP = 1, as in
    the published checkpoints) keeps the shared expert separate under expert parallelism (split over its
    intermediate dim, its own gate; router H -> E): the two ranks' partial outputs, given the folded
    block's weights, sum to the folded block's output."""
    kernels = select_kernels("cpu", torch.float32, backend="reference")
    cfg = tiny_config(
        hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )  # fmt: skip
    assert shared_pseudo_experts(cfg) == 1
    folded = SparseMoeBlock(cfg, kernels, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in folded.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1))
    total = torch.zeros_like(x)
    n, half = e // TP, i // TP
    for r in range(TP):
        par = PartialRank(r, TP)
        layout = TPLayout.from_config(cfg, r, TP, expert_parallel=True)
        block = SparseMoeBlock(cfg, kernels, dtype=torch.float32, layout=layout, parallel=par)
        assert block.num_shared == 0 and block.gate.weight.shape == (e, 32)
        assert block.experts.w13.shape == (n, 2 * i, 32)
        rows = slice(r * half, (r + 1) * half)
        sw13, sw2 = folded.experts.w13[e], folded.experts.w2[e]  # the pseudo-expert: the shared expert
        with torch.no_grad():
            block.gate.weight.copy_(folded.gate.weight[:e])
            block.shared_expert_gate.weight.copy_(folded.gate.weight[e : e + 1])
            block.experts.w13.copy_(folded.experts.w13[r * n : (r + 1) * n])
            block.experts.w2.copy_(folded.experts.w2[r * n : (r + 1) * n])
            block.shared_expert.gate_up_proj.weight.copy_(torch.cat([sw13[:i][rows], sw13[i:][rows]]))
            block.shared_expert.down_proj.weight.copy_(sw2[:, rows])
            total += block(x)
    with torch.no_grad():
        want = folded(x)
    print(f"\nfolded vs expert-parallel sum: max |diff| {(total - want).abs().max().item():.2e}")
    torch.testing.assert_close(total, want, atol=TOL[0], rtol=TOL[1])


def _ep_rank(model_dir, kernels, rank, monkeypatch):
    """Rank ``rank`` of TP = 2 with expert parallelism, loaded; returns (target, mtp, names read)."""
    read: list[str] = []
    real = loader_mod._read

    def spy(ckpt_dir, fname, f, name, pieces=None):
        read.append(name)
        return real(ckpt_dir, fname, f, name, pieces)

    monkeypatch.setattr(loader_mod, "_read", spy)
    cfg = Qwen3NextConfig.from_hf(model_dir)
    cores = DenseCoreFactory(kernels)
    par = RankWithoutGroup(rank, TP)
    target = Qwen3NextForCausalLM(cfg, cores, kernels, parallel=par, expert_parallel=True)
    load_target(target, model_dir)
    mtp = Qwen3NextMTP(
        cfg, cores, kernels, target.model.embed_tokens, target.lm_head, parallel=par, expert_parallel=True
    )
    load_mtp(mtp, model_dir)
    monkeypatch.setattr(loader_mod, "_read", real)
    return target, mtp, read


def _moe_blocks(target, mtp) -> dict[str, SparseMoeBlock]:
    out = {f"target.{n}": m for n, m in target.named_modules() if isinstance(m, SparseMoeBlock)}
    out.update({f"mtp.{n}": m for n, m in mtp.named_modules() if isinstance(m, SparseMoeBlock)})
    return out


def test_each_rank_holds_and_reads_only_its_experts(model_dir, kernels32, dense_models, monkeypatch):
    """Rank r's routed experts are TP = 1's experts ``[r E/2, (r + 1) E/2)`` bit for bit, whole (full
    intermediate size), target and MTP layers alike: 1/2 of the expert bytes; the loader read those experts'
    tensors once each and no other expert's. The shared expert stays split over its intermediate dim."""
    full = _moe_blocks(*dense_models)
    cfg = Qwen3NextConfig.from_hf(model_dir)
    n = cfg.num_experts // TP
    for r in range(TP):
        target, mtp, read = _ep_rank(model_dir, kernels32, r, monkeypatch)
        blocks = _moe_blocks(target, mtp)
        assert blocks.keys() == full.keys() and blocks
        total = mine = 0
        for name, block in blocks.items():
            ref = full[name]
            assert block.experts.expert_start == r * n and block.experts.num_experts == n
            for w in ("w13", "w2"):
                ours, theirs = getattr(block.experts, w), getattr(ref.experts, w)
                assert torch.equal(ours, theirs[r * n : (r + 1) * n]), f"{name}.experts.{w} rank {r}"
                total += theirs.numel() * theirs.element_size()
                mine += ours.numel() * ours.element_size()
            torch.testing.assert_close(block.gate.weight, ref.gate.weight, rtol=0, atol=0)
            shared, ref_shared = block.shared_expert.down_proj.weight, ref.shared_expert.down_proj.weight
            assert shared.shape[1] * TP == ref_shared.shape[1], f"{name}: shared expert not split"
        print(f"\nrank {r}: routed expert bytes {mine:,d} of {total:,d}")
        assert mine * TP == total
        experts_read = [int(m.group(1)) for m in map(EXPERT.search, read) if m]
        assert experts_read and set(experts_read) == set(range(r * n, (r + 1) * n)), sorted(set(experts_read))
        assert len(read) == len(set(read)), "a tensor was read twice"


def test_fp8_checkpoint_ranks_hold_tp1_experts(model_dir, kernels32, tmp_path, monkeypatch):
    """An FP8 block-scaled checkpoint (scripts/make_fp8_checkpoint.py): each expert-parallel rank's
    ``Fp8Experts`` (weights and block scales) are TP = 1's experts ``[r E/2, (r + 1) E/2)`` bit for bit."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_fp8_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_fp8_checkpoint", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ckpt = tmp_path / "tiny-fp8"
    mod.make_fp8_checkpoint(model_dir, ckpt)
    cfg = Qwen3NextConfig.from_hf(ckpt)
    cores = DenseCoreFactory(kernels32)
    one = Qwen3NextForCausalLM(cfg, cores, kernels32)
    load_target(one, ckpt)
    one_mtp = Qwen3NextMTP(cfg, cores, kernels32, one.model.embed_tokens, one.lm_head)
    load_mtp(one_mtp, ckpt)
    full = _moe_blocks(one, one_mtp)
    n = cfg.num_experts // TP
    for r in range(TP):
        blocks = _moe_blocks(*_ep_rank(ckpt, kernels32, r, monkeypatch)[:2])
        assert blocks.keys() == full.keys()
        for name, block in blocks.items():
            assert isinstance(block.experts, Fp8Experts) and block.experts.expert_start == r * n
            for w in ("w13", "w13_scale_inv", "w2", "w2_scale_inv"):
                ours, theirs = getattr(block.experts, w), getattr(full[name].experts, w)[r * n : (r + 1) * n]
                assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), f"{name}.{w} rank {r}"


@pytest.fixture(scope="module")
def ep2(model_dir, greedy_cases):
    """The engine on 2 gloo ranks with expert parallelism: greedy k = 0, 1, 3 over every reference case,
    then k = 1 through the bucketed decode / verify steps. Per rank, per run: (results, seconds)."""
    cases = greedy_cases["cases"]
    greedy = SamplingParams(max_tokens=greedy_cases["max_new_tokens"], ignore_eos=True)
    prompts = [c["prompt_ids"] for c in cases]
    runs = [
        TPRun(EngineConfig(num_speculative_tokens=k, expert_parallel=True, **ENGINE), prompts, greedy)
        for k in KS
    ]
    bucketed = EngineConfig(num_speculative_tokens=1, expert_parallel=True, cuda_graphs=True, **ENGINE)
    runs.append(TPRun(bucketed, prompts, greedy))
    t0 = time.perf_counter()
    out = generate_tp(model_dir, runs, TP, device_type="cpu")
    print(f"TP=2 + EP: {len(runs)} runs on 2 ranks in {time.perf_counter() - t0:.1f} s")
    return out


@pytest.mark.parametrize("run", [*(f"k={k}" for k in KS), "k=1 bucketed"])
def test_tp2_expert_parallel_greedy_reproduces_the_reference(ep2, greedy_cases, run):
    index = [*(f"k={k}" for k in KS), "k=1 bucketed"].index(run)
    k = KS[index] if index < len(KS) else 1
    cases = greedy_cases["cases"]
    for rank, runs in enumerate(ep2):
        results, _ = runs[index]
        mismatch = greedy_mismatch(results, cases)
        if mismatch:
            pytest.fail(f"TP=2 + EP rank {rank} {run}: {mismatch}")
        if k:
            drafted = sum(r.stats.num_draft_tokens for r in results)
            accepted = sum(r.stats.num_accepted_tokens for r in results)
            assert accepted >= MIN_ACCEPTANCE[k] * drafted, (
                f"rank {rank} {run}: acceptance {accepted}/{drafted}"
            )
    stats = [[(r.stats.num_drafts, r.stats.num_accepted_tokens) for r in runs[index][0]] for runs in ep2]
    assert stats[0] == stats[1]


def test_atom_generate_expert_parallel_prints_the_tp1_text(model_dir, capsys):
    from atom_models.cli import main

    argv = ["--model", str(model_dir), "--prompt", "import os\ndef main(", "--max-tokens", "10"]
    argv += ["--speculative-tokens", "1", "--ignore-eos"]
    assert main(argv) == 0
    tp1 = capsys.readouterr().out
    assert main([*argv, "--tensor-parallel-size", "2", "--expert-parallel"]) == 0
    ep = capsys.readouterr().out
    keep = lambda out: [line for line in out.splitlines() if not line.startswith(("10 tokens in", "MTP k=1"))]  # noqa: E731
    assert keep(tp1) and keep(tp1) == keep(ep)
