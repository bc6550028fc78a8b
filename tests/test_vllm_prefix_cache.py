"""Prefix caching, vLLM's default, through the ATOM plugin: float32, k = 0, 1, 3 on vLLM-CPU.

One engine per k with prefix caching on (vLLM's Mamba "align" mode, 256-token blocks for this model) runs
greedy.json's prompts and the multi-turn workload of ``_multiturn`` (each turn the conversation so far
plus new text; prompts ending inside a block; block boundaries crossed inside MTP draft windows;
concurrent requests resuming from the same shared blocks). The k = 1 and k = 3 engines run at vLLM's
defaults, where the plugin sets ``prefix_match_unit`` to 16 tokens (``atom_vllm_plugin.config_hook``): hits
land inside blocks. The k = 0 engine passes ``prefix_match_unit`` = the block size, as a user may: the
plugin keeps it and hits are whole blocks. Checks:

- greedy.json is reproduced token for token;
- every token of the workload is the float32 argmax of the conversation so far, teacher-forced through
  transformers (the caching-off engine emits the same: its outputs are the float32 argmax too; the
  benchmark ``benchmarks/vllm_prefix_cache.py`` compares on and off token for token);
- vLLM's prefix-cache counters show the hits the workload implies: later turns resume from cached
  states, the counter equals the requests' cached tokens, each a whole number of units;
- with a KV pool too small for the turn's requests (k = 3), vLLM preempts, and the outputs stay exact;
- at the defaults (k = 1), a repeated prompt resumes from a state inside a block (vLLM copies the shared
  attention and GDN blocks for the request) and repeats its tokens.
"""

from __future__ import annotations

import pytest
from _multiturn import SYSTEM_LEN, conversation_job, token_pool
from _reference import consistency
from _vllm import engine_run, greedy_differences, greedy_job, model_dir, plan, requires_vllm, spec, vllm_runs

pytestmark = [requires_vllm, pytest.mark.slow]

BLOCK = 256  # vLLM's block size for this model (attention pages padded to the GDN state page)
MAX_GAP = 0.01  # float32: every token is the reference argmax (gaps are rounding noise, about 1e-6)


POOL = 24  # KV blocks of the preemption run
UNIT = 16  # the plugin's default prefix_match_unit
REPEAT_LENS = (470, 749)  # hits at 448 and 720: 192 and 208 tokens into a block, 22 and 29 recomputed
UNITS = {0: BLOCK, 1: UNIT, 3: UNIT}  # k -> the unit hits land on (k = 0 passes the block size)


def _repeat_job() -> dict:
    pool = token_pool()
    prompts = [pool[1000 * i : 1000 * i + n] for i, n in enumerate(REPEAT_LENS)]
    return {"name": "repeat", "prompt_token_ids": prompts, "max_tokens": 32, "repeat": 2}


def _spec(k: int, *extra_jobs, **llm_kwargs) -> dict:
    return spec(
        plugin=True,
        dtype="float32",
        k=k,
        jobs=[greedy_job(), conversation_job(), *extra_jobs],
        llm_kwargs={"enable_prefix_caching": True, "max_model_len": 1024, **llm_kwargs},
    )


plan("f32_prefix_k0", lambda: _spec(0, prefix_match_unit=BLOCK))  # a user's unit: kept by the plugin
plan("f32_prefix_k1", lambda: _spec(1, _repeat_job()))  # vLLM's defaults: the plugin's unit
plan("f32_prefix_k3", lambda: _spec(3))
plan("f32_prefix_k3_preempt", lambda: _spec(3, num_gpu_blocks_override=POOL))


def _check_conversation(r, unit: int) -> list[dict]:
    turns = r["jobs"]["conversation"]["turns"]
    prompts = [p for t in turns for p in t["prompt_token_ids"]]
    outputs = [o for t in turns for o in t["token_ids"]]
    assert all(len(o) == 64 for o in outputs), [len(o) for o in outputs]
    c = consistency(str(model_dir()), prompts, outputs)
    assert c.max_gap <= MAX_GAP, f"a token with prefix caching is not the float32 argmax: {c}"
    for t in turns:
        cached = t["num_cached_tokens"]
        assert t["spec"]["prefix_cache_hits"] == sum(cached), (t["spec"], cached)
        assert all(n % unit == 0 and n < len(p) for n, p in zip(cached, t["prompt_token_ids"])), cached
    return turns


@pytest.mark.parametrize("k", [0, 1, 3])
@vllm_runs("f32_prefix_k{k}")
def test_prefix_caching_multiturn_float32(k: int) -> None:
    r = engine_run(f"f32_prefix_k{k}")
    bad = greedy_differences(r["jobs"]["greedy"]["token_ids"])
    assert not bad, "float32 with prefix caching differs from greedy.json:\n" + "\n".join(bad)
    unit = UNITS[k]
    turns = _check_conversation(r, unit)
    # first turn: only the shared 300-token system prompt can hit, in a later step than the request that
    # computes it (vLLM defers a hit on a block cached in the same step); with MTP vLLM drops the last
    # matched unit, so at block granularity only k = 0 hits there. Every conversation of the last turn
    # resumes, some two blocks in.
    first = turns[0]["num_cached_tokens"]
    assert all(n <= SYSTEM_LEN // unit * unit for n in first) and (k > 0 or sum(first) > 0), first
    last = turns[3]["num_cached_tokens"]
    assert all(n >= BLOCK for n in last) and max(last) >= 2 * BLOCK, last
    # conversation 4 repeats conversation 0's third prompt: it resumes at that prompt's last unit boundary
    # (one unit earlier with MTP: vLLM drops the last matched unit for the draft)
    repeat_len = len(turns[2]["prompt_token_ids"][0])
    assert last[4] == repeat_len // unit * unit - (unit if k > 0 else 0), (last, repeat_len)
    if unit < BLOCK:  # hits inside blocks
        assert any(n % BLOCK for t in turns for n in t["num_cached_tokens"]), [
            t["num_cached_tokens"] for t in turns
        ]
    if k > 0:
        assert r["jobs"]["greedy"]["acceptance_rate"] > 0.2, r["jobs"]["greedy"]["spec"]


@vllm_runs("f32_prefix_k3_preempt")
def test_prefix_caching_with_preemption_float32() -> None:
    """KV pool of POOL blocks: the last turns' requests (4 attention blocks each, plus their GDN state
    blocks) do not fit at once, so vLLM preempts and later recomputes or re-hits them."""
    r = engine_run("f32_prefix_k3_preempt")
    bad = greedy_differences(r["jobs"]["greedy"]["token_ids"])
    assert not bad, "float32 with prefix caching differs from greedy.json:\n" + "\n".join(bad)
    turns = _check_conversation(r, UNIT)
    assert sum(t["spec"]["num_preemptions"] for t in turns) > 0, (
        "the small KV pool did not force a preemption"
    )
    assert sum(t["spec"]["prefix_cache_hits"] for t in turns) > 0


@vllm_runs("f32_prefix_k1")
def test_prefix_hit_inside_a_block_at_defaults_float32() -> None:
    """At vLLM's defaults (the plugin's ``UNIT``), the second run of each prompt resumes at the prompt's last
    unit boundary that vLLM keeps with MTP (one unit before the last full unit), inside a 256-token block,
    and emits the first run's tokens, each the float32 argmax."""
    r = engine_run("f32_prefix_k1")
    first, again = r["jobs"]["repeat"]["runs"]
    prompts = _repeat_job()["prompt_token_ids"]
    hits = [n // UNIT * UNIT - UNIT for n in REPEAT_LENS]
    assert again["num_cached_tokens"] == hits and all(h % BLOCK for h in hits), again["num_cached_tokens"]
    assert again["token_ids"] == first["token_ids"], "a prefix hit inside a block changed the tokens"
    c = consistency(str(model_dir()), prompts * 2, first["token_ids"] + again["token_ids"])
    assert c.max_gap <= MAX_GAP, f"a token is not the float32 argmax: {c}"
