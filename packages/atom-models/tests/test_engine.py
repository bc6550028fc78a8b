"""Standalone engine: lossless MTP speculative decoding, mixed batches, slot freeing."""

from __future__ import annotations

import pytest
import torch
from _helpers import MIN_ACCEPTANCE
from atom_models.engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engines(model_dir):
    """One float32 engine per k (built lazily, reused by the tests of this module)."""
    cache: dict[tuple, LLMEngine] = {}

    def get(k: int, **kw) -> LLMEngine:
        key = (k, tuple(sorted(kw.items())))
        if key not in cache:
            cfg = EngineConfig(num_speculative_tokens=k, **{"max_model_len": 256, "max_num_seqs": 8, **kw})
            cache[key] = LLMEngine.from_pretrained(model_dir, cfg, dtype=torch.float32)
        return cache[key]

    return get


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_greedy_lossless(engines, greedy_cases, k):
    """float32 greedy with k drafts reproduces transformers' greedy continuations token for token."""
    cases = greedy_cases["cases"]
    eng = engines(k)
    params = SamplingParams(max_tokens=greedy_cases["max_new_tokens"], ignore_eos=True)
    results = eng.generate([c["prompt_ids"] for c in cases], params)
    for i, (r, c) in enumerate(zip(results, cases)):
        if r.output_ids != c["greedy_ids"]:
            j = next(j for j, (a, b) in enumerate(zip(r.output_ids, c["greedy_ids"])) if a != b)
            pytest.fail(
                f"k={k} case {i}: first mismatch at token {j} (reference margin {c['top1_margin'][j]:.4f})"
            )
    if k:
        drafted = sum(r.stats.num_draft_tokens for r in results)
        accepted = sum(r.stats.num_accepted_tokens for r in results)
        assert accepted >= MIN_ACCEPTANCE[k] * drafted, (
            f"k={k}: acceptance {accepted}/{drafted} below {MIN_ACCEPTANCE[k]} (measured - 0.05)"
        )
        assert all(len(r.stats.accepted_per_position) == k for r in results)
        # fewer target steps than tokens: speculation really skipped steps
        assert sum(r.num_steps for r in results) < sum(len(r.output_ids) for r in results)
    assert eng.caches.blocks.num_free == eng.caches.blocks.num_blocks
    assert eng.caches.slots.num_free == eng.caches.slots.num_slots


def test_mixed_batch_equals_separate(engines, greedy_cases):
    """One step holding a prefill, a plain decode and a verification gives the same tokens as running
    the three requests alone."""
    cases = greedy_cases["cases"]
    eng = engines(2)
    prompts = [cases[0]["prompt_ids"][:20], cases[1]["prompt_ids"][:35], cases[2]["prompt_ids"]]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, num_speculative_tokens=0),  # plain decodes
        SamplingParams(max_tokens=15, ignore_eos=True),  # verifications with 2 drafts
        SamplingParams(max_tokens=10, ignore_eos=True, num_speculative_tokens=1),  # joins later: a prefill
    ]
    alone = [eng.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params)]

    ids = [eng.add_request(prompts[0], params[0]), eng.add_request(prompts[1], params[1])]
    first = eng.step()
    assert (first.num_prefills, first.num_decodes, first.num_verifies) == (2, 0, 0)
    ids.append(eng.add_request(prompts[2], params[2]))
    mixed = eng.step()
    assert (mixed.num_prefills, mixed.num_decodes, mixed.num_verifies) == (1, 1, 1), mixed
    assert mixed.num_tokens == len(prompts[2]) + 1 + 3
    reqs = {r.request_id: r for r in eng.running}
    while eng.has_unfinished():
        eng.step()
    together = [reqs[i].output_ids for i in ids]
    assert together == alone


def test_requests_finish_at_different_steps_and_free_slots(engines, greedy_cases):
    cases = greedy_cases["cases"]
    eng = engines(3, max_num_seqs=2, num_blocks=40)
    blocks, slots = eng.caches.blocks, eng.caches.slots
    lens = [(13, 2), (48, 20), (30, 7)]  # (prompt length, max_tokens)
    prompts = [c["prompt_ids"][:n] for c, (n, _) in zip(cases, lens)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in lens]
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    reqs = list(eng.waiting)
    finished_at: dict[int, int] = {}
    admitted_at: dict[int, int] = {}
    step = 0
    while eng.has_unfinished():
        info = eng.step()
        step += 1
        for r in eng.running:
            admitted_at.setdefault(r.request_id, step)
        for rid in info.finished:
            finished_at[rid] = step
            admitted_at.setdefault(rid, step)
        # everything not held by a running request is back in the free lists
        assert blocks.num_free == blocks.num_blocks - sum(len(r.blocks) for r in eng.running)
        assert slots.num_free == slots.num_slots - len(eng.running)
        assert len(eng.running) <= 2
    assert set(finished_at) == set(ids)
    # request 0 finishes first; request 2 only gets in once a GDN slot was freed
    assert finished_at[ids[0]] < finished_at[ids[1]]
    assert admitted_at[ids[2]] == finished_at[ids[0]] + 1
    assert blocks.num_free == blocks.num_blocks and slots.num_free == slots.num_slots
    assert all(r.slot == -1 for r in reqs)
    # request 2 reused request 0's slot (stale state and pending row): still the non-speculative tokens
    plain = engines(0, max_num_seqs=2, num_blocks=40)
    assert [r.output_ids for r in reqs] == [
        plain.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params)
    ]


def test_temperature_sampling_is_seeded_and_speculation_keeps_running(engines, greedy_cases):
    prompt = greedy_cases["cases"][3]["prompt_ids"]
    eng = engines(2)
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    a = eng.generate([prompt], sp)[0]
    b = eng.generate([prompt], sp)[0]
    assert a.output_ids == b.output_ids and len(a.output_ids) == 24
    assert a.stats.num_drafts > 0


def test_eos_inside_accepted_drafts_stops_the_request(model_dir, greedy_cases):
    """A stop token among the accepted drafts ends the request there; later tokens are dropped."""
    import dataclasses

    from atom_core import Qwen3NextConfig
    from atom_models import load_mtp, load_target

    case = greedy_cases["cases"][5]
    stop = case["greedy_ids"][20]
    cut = case["greedy_ids"].index(stop)
    cfg = dataclasses.replace(Qwen3NextConfig.from_hf(model_dir), eos_token_id=(stop,))
    eng = LLMEngine(cfg, EngineConfig(num_speculative_tokens=3, max_model_len=256, max_num_seqs=2))
    load_target(eng.target, model_dir)
    load_mtp(eng.mtp, model_dir)
    res = eng.generate([case["prompt_ids"]], SamplingParams(max_tokens=64))[0]
    assert res.finish_reason == "stop"
    assert res.output_ids == case["greedy_ids"][: cut + 1]
    # the path under test was taken: the steps produced more tokens (1 from the prefill, then accepted
    # drafts + 1 per verification) than were emitted, so the stop token was an accepted draft and the
    # tokens after it in that step were dropped (a stop as the corrected/bonus token drops nothing)
    produced = 1 + res.stats.num_drafts + res.stats.num_accepted_tokens
    assert res.num_steps == 1 + res.stats.num_drafts
    assert produced > len(res.output_ids), (produced, len(res.output_ids), res.stats.as_dict())
    assert eng.caches.slots.num_free == eng.caches.slots.num_slots


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_greedy_lossless_cuda(model_dir, greedy_cases, k, graphs):
    """The same lossless check on a GPU with the best kernels there (triton), decode/verify steps replayed
    from CUDA graphs or run eagerly; max_tokens differ per prompt so the batch shrinks through buckets."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (runs on the GPU machine)")
    cases = greedy_cases["cases"]
    cfg = EngineConfig(num_speculative_tokens=k, max_model_len=256, max_num_seqs=8, cuda_graphs=graphs)
    eng = LLMEngine.from_pretrained(model_dir, cfg, device="cuda")
    lens = [64, 64, 64, 64, 64, 48, 30, 9]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
    res = eng.generate([c["prompt_ids"] for c in cases], params)
    mismatched = [
        i for i, (r, c, n) in enumerate(zip(res, cases, lens)) if r.output_ids != c["greedy_ids"][:n]
    ]
    assert not mismatched, f"k={k} on cuda: cases {mismatched} differ from the float32 reference"
    if graphs:
        assert eng.graphs is not None and eng.graphs.num_captured > 0


def test_speculative_sampling_follows_the_target_distribution(engines, dense_models, greedy_cases):
    """temperature > 0, k = 1: the 2nd token comes out of rejection sampling (draft d accepted, or a
    resample from max(0, p - q)); it must follow the TARGET p, not the draft q. Statistic: the mean of
    log p(t)/q(t) over the samples, whose expectation is KL(p||q) if t ~ p and -KL(q||p) if t ~ q, with
    its standard error from Var_p (exact distributions from the dense float32 models)."""
    import math

    from atom_models.engine.sampling import probs_from_logits

    target, mtp = dense_models
    prompt = greedy_cases["cases"][1]["prompt_ids"][:16]
    n, temp = 192, 2.0
    eng = engines(1)
    res = eng.generate(
        [prompt] * n,
        [SamplingParams(max_tokens=2, temperature=temp, seed=s, ignore_eos=True) for s in range(n)],
    )
    assert sum(r.stats.num_accepted_tokens for r in res) > 0
    sp = SamplingParams(temperature=temp)
    per_first: dict[int, tuple] = {}
    stat, under_p, under_q, var = 0.0, 0.0, 0.0, 0.0
    with torch.no_grad():
        for r in res:
            first, second = r.output_ids
            if first not in per_first:
                ids = torch.tensor([*prompt, first])
                h = target(ids, torch.arange(len(ids)))
                p = probs_from_logits(target.compute_logits(h[-1]), sp)
                q = probs_from_logits(
                    mtp.compute_logits(mtp(ids[1:], torch.arange(len(ids) - 1), h[:-1])[-1]), sp
                )
                lr = p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log()
                a = float((p * lr).sum())
                per_first[first] = (lr, a, float((q * lr).sum()), float((p * lr**2).sum()) - a * a)
            lr, a, b, v = per_first[first]
            stat, under_p, under_q, var = stat + float(lr[second]), under_p + a, under_q + b, var + v
    se = math.sqrt(var) / n
    z_p, z_q = (stat - under_p) / n / se, (stat - under_q) / n / se
    print(
        f"mean log p/q {stat / n:.4f}: expected {under_p / n:.4f} if ~p (z={z_p:.2f}), {under_q / n:.4f} if ~q (z={z_q:.2f})"
    )
    # measured: z_p = 1.18, z_q = 24.0
    assert abs(z_p) < 4, f"second tokens do not follow the target distribution (z={z_p:.2f})"


def test_token_budget_holds_back_a_prompt_while_decodes_use_it(engines, greedy_cases):
    """max_num_batched_tokens counts the running decodes: a prompt that fits alone but not beside them
    waits; a prompt longer than the budget is refused at add_request."""
    cases = greedy_cases["cases"]
    eng = engines(0, max_num_batched_tokens=40)
    a = eng.add_request(cases[0]["prompt_ids"][:30], SamplingParams(max_tokens=3, ignore_eos=True))
    first = eng.step()
    assert first.num_prefills == 1
    eng.add_request(cases[1]["prompt_ids"][:40], SamplingParams(max_tokens=2, ignore_eos=True))
    second = eng.step()  # 1 decode token running: 40 prompt tokens do not fit in 40 - 1
    assert (second.num_prefills, second.num_decodes, second.num_tokens) == (0, 1, 1), second
    infos = [second]
    while eng.has_unfinished():
        infos.append(eng.step())
    assert all(i.num_tokens <= 40 for i in infos), [i.num_tokens for i in infos]
    assert a in infos[1].finished and infos[2].num_prefills == 1
    with pytest.raises(ValueError, match="max_num_batched_tokens 40"):
        eng.add_request(cases[1]["prompt_ids"][:41], SamplingParams(max_tokens=2))


def test_step_copies_no_full_vocabulary_logits_for_greedy(engines, greedy_cases, monkeypatch):
    """Greedy requests take their argmax on the device (only ints reach the host); a sampled request
    copies only its own rows' probabilities (at most 1 + k per copy), never the batch's logits."""
    cases = greedy_cases["cases"]
    eng = engines(2)
    vocab = eng.config.vocab_size
    copied: list[tuple[int, ...]] = []
    real_cpu = torch.Tensor.cpu

    def spy_cpu(self, *args, **kwargs):
        if self.dim() >= 1 and self.shape[-1] == vocab:
            copied.append(tuple(self.shape))
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", spy_cpu)
    prompts = [cases[0]["prompt_ids"][:20], cases[1]["prompt_ids"][:25]]
    eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert copied == [], f"greedy steps copied vocabulary-sized tensors to the host: {copied[:4]}"
    sampled = SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True)
    eng.generate(prompts, [SamplingParams(max_tokens=8, ignore_eos=True), sampled])
    assert copied and all(s[0] <= 3 for s in copied), copied


def test_bf16_engine_holds_float32_experts_with_the_same_tokens(model_dir, greedy_cases):
    """A bf16 CPU engine built by ``from_pretrained`` holds its experts' weights in float32 once (the CPU
    expert backends take float32 weights) and emits the tokens of an engine that converts on every call."""
    from atom_kernels.ops.moe import prefers_float32_weights
    from atom_models.engine.engine import load_mtp, load_target
    from atom_models.moe import Experts

    cfg = EngineConfig(num_speculative_tokens=1, max_model_len=256, max_num_seqs=4)
    held = LLMEngine.from_pretrained(model_dir, cfg, dtype=torch.bfloat16)
    if not prefers_float32_weights(held.kernels.backends.get("moe_experts", "")):
        pytest.skip(f"moe_experts backend {held.kernels.backends.get('moe_experts')} runs on bf16 weights")
    per_call = LLMEngine(held.config, cfg, dtype=torch.bfloat16)
    load_target(per_call.target, model_dir)
    load_mtp(per_call.mtp, model_dir)
    dtypes = {m.w13.dtype for eng in (held, per_call) for m in eng.target.modules() if isinstance(m, Experts)}
    assert {m.w13.dtype for m in held.target.modules() if isinstance(m, Experts)} == {torch.float32}
    assert {m.w2.dtype for m in held.mtp.modules() if isinstance(m, Experts)} == {torch.float32}
    assert torch.bfloat16 in dtypes
    prompts = [c["prompt_ids"] for c in greedy_cases["cases"][:3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    a = [r.output_ids for r in held.generate(prompts, params)]
    b = [r.output_ids for r in per_call.generate(prompts, params)]
    assert a == b
