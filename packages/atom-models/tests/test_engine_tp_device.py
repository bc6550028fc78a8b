"""The standalone engine at tensor parallelism 2 on GPUs (the tiny fixture, atom-kernels' GPU backend).

With two or more GPUs the ranks talk over NCCL (rank r on ``cuda:r``) and the bucketed decode / verify
forwards are captured in CUDA graphs; with one GPU both ranks share it over gloo (whose collectives copy
through the host and cannot be captured, so the same bucketed forwards run eagerly). Checked: float32
``greedy.json`` exact for k = 0..3 (plain and bucketed steps), and bf16 MTP acceptance on
``prompts.json`` (k = 1) within one point of TP = 1 on the same device.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from _helpers import greedy_mismatch
from atom_models.engine import EngineConfig, LLMEngine, SamplingParams
from atom_models.engine.tp_launch import TPRun, generate_tp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KS = (0, 1, 2, 3)
ENGINE = dict(max_model_len=512, max_num_seqs=16)
ACCEPTANCE_POINTS = 1.0  # TP = 2 vs TP = 1, bf16, k = 1, prompts.json: percentage points


def _backend() -> str:
    return "nccl" if torch.cuda.device_count() >= 2 else "gloo"


def _acceptance(results) -> tuple[int, int]:
    return sum(r.stats.num_accepted_tokens for r in results), sum(r.stats.num_draft_tokens for r in results)


@pytest.fixture(scope="module")
def prompts(ref_dir):
    raw = json.loads((ref_dir / "prompts.json").read_text())
    params = SamplingParams(max_tokens=raw["max_tokens"], ignore_eos=True)
    return [p["prompt_token_ids"] for p in raw["prompts"]], params


@pytest.fixture(scope="module")
def tp2(model_dir, greedy_cases, prompts):
    """Per rank, per run: (results, seconds). Runs: float32 greedy for each k, the bucketed path (k = 2),
    then bf16 k = 1 on prompts.json."""
    cases = greedy_cases["cases"]
    greedy = SamplingParams(max_tokens=greedy_cases["max_new_tokens"], ignore_eos=True)
    ids = [c["prompt_ids"] for c in cases]
    runs = [
        TPRun(EngineConfig(num_speculative_tokens=k, cuda_graphs=False, **ENGINE), ids, greedy) for k in KS
    ]
    runs.append(TPRun(EngineConfig(num_speculative_tokens=2, cuda_graphs=True, **ENGINE), ids, greedy))
    t0 = time.perf_counter()
    out = generate_tp(model_dir, runs, 2, dtype=torch.float32, device_type="cuda", backend=_backend())
    bf16 = generate_tp(
        model_dir,
        [TPRun(EngineConfig(num_speculative_tokens=1, **ENGINE), *prompts)],
        2,
        dtype=torch.bfloat16,
        device_type="cuda",
        backend=_backend(),
    )
    print(f"TP=2 on {torch.cuda.device_count()} GPU(s) over {_backend()}: {time.perf_counter() - t0:.1f} s")
    return [a + b for a, b in zip(out, bf16)]


@pytest.mark.parametrize("k", KS)
def test_tp2_on_gpus_reproduces_the_float32_reference(tp2, greedy_cases, k):
    for rank, runs in enumerate(tp2):
        results, _ = runs[KS.index(k)]
        mismatch = greedy_mismatch(results, greedy_cases["cases"])
        if mismatch:
            pytest.fail(f"TP=2 ({_backend()}) rank {rank} k={k} {mismatch}")


def test_tp2_on_gpus_bucketed_steps_reproduce_the_reference(tp2, greedy_cases):
    for rank, runs in enumerate(tp2):
        results, _ = runs[len(KS)]
        assert [r.output_ids for r in results] == [c["greedy_ids"] for c in greedy_cases["cases"]], rank


def test_tp2_on_gpus_bf16_acceptance_matches_tp1(tp2, model_dir, prompts):
    ids, params = prompts
    eng = LLMEngine.from_pretrained(
        model_dir, EngineConfig(num_speculative_tokens=1, **ENGINE), dtype=torch.bfloat16, device="cuda"
    )
    acc1, drafts1 = _acceptance(eng.generate(ids, params))
    per_rank = [_acceptance(runs[len(KS) + 1][0]) for runs in tp2]
    acc2, drafts2 = per_rank[0]
    rate1, rate2 = 100.0 * acc1 / drafts1, 100.0 * acc2 / drafts2
    print(
        f"bf16 k=1 prompts.json acceptance: TP=1 {acc1}/{drafts1} = {rate1:.2f}%, TP=2 {acc2}/{drafts2} = {rate2:.2f}%"
    )
    assert per_rank[0] == per_rank[1], f"the ranks disagree: {per_rank}"
    assert abs(rate2 - rate1) <= ACCEPTANCE_POINTS, f"TP=2 {rate2:.2f}% vs TP=1 {rate1:.2f}%"
