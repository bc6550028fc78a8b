"""bfloat16 through vLLM: ATOM plugin vs stock vLLM (ATOM_DISABLE_VLLM_PLUGIN=1) on prompts.json.

Same prompts, same dtype, same engine settings, same test session: the plugin's MTP acceptance rate must
not be lower than stock's minus 2 points, and its greedy consistency against the float32 reference
(teacher-forced, see _reference.py) no worse than stock's beyond bf16 near-tie noise.

At k = 3 the acceptance of the 2nd and 3rd drafts depends on the text being drafted: where stock's and the
plugin's bf16 targets pick different tokens (near-ties: 9 of the 16 prompts at 128 tokens), the two texts
diverge, and the more repetitive one accepts more (measured: on rounds whose text was still identical,
stock [282, 168, 108] and plugin [281, 167, 107] accepted per position; after divergence [151, 110, 69]
and [127, 80, 44]). The k = 3 check therefore compares acceptance over the prompts whose outputs are
identical in both runs (each prompt generated alone, with its own counters): the same text, the same
drafting work.
"""

from __future__ import annotations

import pytest
from _reference import consistency
from _vllm import (
    engine_run,
    model_dir,
    plan,
    prompt_set,
    requires_vllm,
    spec,
    vllm_runs,
)

pytestmark = [requires_vllm, pytest.mark.slow]

ACCEPTANCE_MARGIN = 0.02  # the bar: plugin >= stock - 2 points
# Greedy consistency: the plugin may emit a few more near-tie tokens than stock (bf16 rounding differs
# between implementations), but no token far from the float32 argmax. Stock bf16 eager measured on this
# fixture (README): 18 of 2048 off-argmax with MTP, largest gap 1.59 logits.
EXTRA_OFF_ARGMAX = 8
MAX_GAP_SLACK = 0.5


def _runs(k: int, enforce_eager: bool = True):
    tag = "eager" if enforce_eager else "compiled"
    stock, atom = engine_run(f"bf16_stock_k{k}_{tag}"), engine_run(f"bf16_plugin_k{k}_{tag}")
    return stock["jobs"]["prompts"], atom["jobs"]["prompts"]


K1_RUNS = vllm_runs("bf16_stock_k1_{tag}", "bf16_plugin_k1_{tag}")


@K1_RUNS
@pytest.mark.parametrize(("k", "tag"), [(1, "eager"), (1, "compiled")], ids=["k1-eager", "k1-compiled"])
def test_bf16_acceptance_not_below_stock(k: int, tag: str) -> None:
    stock, atom = _runs(k, tag == "eager")
    print(
        f"k={k}: stock {stock['spec']} rate {stock['acceptance_rate']:.4f}; plugin {atom['spec']} rate {atom['acceptance_rate']:.4f}"
    )
    assert atom["acceptance_rate"] >= stock["acceptance_rate"] - ACCEPTANCE_MARGIN, (
        f"k={k}: plugin acceptance {atom['acceptance_rate']:.4f} < stock {stock['acceptance_rate']:.4f} - "
        f"{ACCEPTANCE_MARGIN}"
    )
    assert len(atom["spec"]["accepted_per_pos"]) == k


@K1_RUNS
@pytest.mark.parametrize(("k", "tag"), [(1, "eager"), (1, "compiled")], ids=["k1-eager", "k1-compiled"])
def test_bf16_greedy_consistency_not_worse_than_stock(k: int, tag: str) -> None:
    stock, atom = _runs(k, tag == "eager")
    prompts, _ = prompt_set()
    c_stock = consistency(str(model_dir()), prompts, stock["token_ids"])
    c_atom = consistency(str(model_dir()), prompts, atom["token_ids"])
    print(f"k={k}: stock {c_stock}; plugin {c_atom}")
    assert c_atom.off_argmax <= c_stock.off_argmax + EXTRA_OFF_ARGMAX, (c_atom, c_stock)
    assert c_atom.max_gap <= c_stock.max_gap + MAX_GAP_SLACK, (c_atom, c_stock)


MIN_COMMON_PROMPTS = 4  # measured: 6 of 16 prompts give identical 128-token outputs in stock and plugin


def _per_prompt_jobs() -> list[dict]:
    prompts, max_tokens = prompt_set()
    return [
        {"name": f"p{i}", "prompt_token_ids": [p], "max_tokens": max_tokens} for i, p in enumerate(prompts)
    ]


for _impl in ("stock", "plugin"):
    plan(
        f"bf16_{_impl}_k3_per_prompt",
        lambda p=_impl == "plugin": spec(plugin=p, dtype="bfloat16", k=3, jobs=_per_prompt_jobs()),
    )


@vllm_runs("bf16_stock_k3_per_prompt", "bf16_plugin_k3_per_prompt")
def test_bf16_k3_acceptance_on_identical_text_not_below_stock() -> None:
    jobs = _per_prompt_jobs()
    stock = engine_run("bf16_stock_k3_per_prompt")["jobs"]
    atom = engine_run("bf16_plugin_k3_per_prompt")["jobs"]
    common = [j["name"] for j in jobs if stock[j["name"]]["token_ids"] == atom[j["name"]]["token_ids"]]

    def rate(runs, names):
        accepted = sum(runs[n]["spec"]["num_accepted_tokens"] for n in names)
        drafted = sum(runs[n]["spec"]["num_draft_tokens"] for n in names)
        return accepted / max(drafted, 1)

    names = [j["name"] for j in jobs]
    print(
        f"k=3, {len(common)} of {len(jobs)} prompts with identical outputs: stock {rate(stock, common):.4f}, "
        f"plugin {rate(atom, common):.4f}; all prompts: stock {rate(stock, names):.4f}, plugin {rate(atom, names):.4f}"
    )
    assert len(common) >= MIN_COMMON_PROMPTS, f"only {len(common)} prompts with identical outputs: {common}"
    assert rate(atom, common) >= rate(stock, common) - ACCEPTANCE_MARGIN, (
        f"k=3 on identical text: plugin {rate(atom, common):.4f} < stock {rate(stock, common):.4f} - "
        f"{ACCEPTANCE_MARGIN}"
    )
