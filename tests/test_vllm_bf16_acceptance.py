"""bfloat16 through vLLM: ATOM plugin vs stock vLLM (ATOM_DISABLE_VLLM_PLUGIN=1) on prompts.json.

Same prompts, same dtype, same engine settings, same test session: the plugin's MTP acceptance rate must
not be lower than stock's minus 2 points, and its greedy consistency against the float32 reference
(teacher-forced, see _reference.py) no worse than stock's beyond bf16 near-tie noise.

The acceptance is compared over the prompts whose outputs are identical in both runs (each prompt
generated alone, with its own counters): the same text, the same drafting work. Where stock's and the
plugin's bf16 targets pick different near-tie tokens the texts diverge, and the acceptance of a diverged
text moves by tens of points either way, so the free-running rate of the whole set moves by several points
with equally exact roundings (docs/performance.md: at k = 1, stock compiled 59.0% against stock eager
63.2%, 9 of 16 texts different; the plugin eager 57.0 / 63.4 / 63.2% with the C pass / the torch form /
the reference op in the prompt step, all float32-exact, while on identical text every pair measured
agreed within 0.4 points). At k = 3 (measured: on rounds whose
text was still identical, stock [282, 168, 108] and plugin [281, 167, 107] accepted per position; after
divergence [151, 110, 69] and [127, 80, 44]) the same holds per draft position.
"""

from __future__ import annotations

import pytest
from _reference import consistency
from _vllm import (
    engine_run,
    model_dir,
    per_prompt_jobs,
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


MIN_COMMON_PROMPTS = 4  # measured: 6-7 of 16 prompts give identical 128-token outputs in stock and plugin


def _identical_text_rates(stock: dict, atom: dict) -> tuple[list[str], float, float, float, float]:
    """Over the per-prompt jobs of two runs: the prompts with identical outputs, the acceptance of stock
    and plugin on those, and on all prompts."""
    names = [j["name"] for j in per_prompt_jobs()]
    common = [n for n in names if stock[n]["token_ids"] == atom[n]["token_ids"]]

    def rate(runs, names):
        accepted = sum(runs[n]["spec"]["num_accepted_tokens"] for n in names)
        drafted = sum(runs[n]["spec"]["num_draft_tokens"] for n in names)
        return accepted / max(drafted, 1)

    return common, rate(stock, common), rate(atom, common), rate(stock, names), rate(atom, names)


K1_RUNS = vllm_runs("bf16_stock_k1_{tag}", "bf16_plugin_k1_{tag}")


@K1_RUNS
@pytest.mark.parametrize(("k", "tag"), [(1, "eager"), (1, "compiled")], ids=["k1-eager", "k1-compiled"])
def test_bf16_acceptance_not_below_stock(k: int, tag: str) -> None:
    stock_batch, atom_batch = _runs(k, tag == "eager")
    stock, atom = engine_run(f"bf16_stock_k{k}_{tag}")["jobs"], engine_run(f"bf16_plugin_k{k}_{tag}")["jobs"]
    common, on_stock, on_atom, all_stock, all_atom = _identical_text_rates(stock, atom)
    print(
        f"k={k} {tag}, {len(common)} of 16 prompts with identical outputs: stock {on_stock:.4f}, plugin "
        f"{on_atom:.4f}; each prompt alone, all: stock {all_stock:.4f}, plugin {all_atom:.4f}; one batch: "
        f"stock {stock_batch['acceptance_rate']:.4f}, plugin {atom_batch['acceptance_rate']:.4f}"
    )
    assert len(common) >= MIN_COMMON_PROMPTS, f"only {len(common)} prompts with identical outputs: {common}"
    assert on_atom >= on_stock - ACCEPTANCE_MARGIN, (
        f"k={k} {tag} on identical text: plugin {on_atom:.4f} < stock {on_stock:.4f} - {ACCEPTANCE_MARGIN}"
    )
    # every prompt, each generated alone (no batch-composition effects), float32 GDN states on both sides
    # (_vllm.py): measured eager stock 61.75%, plugin 63.83% (AMX Xeon); on an AVX2 AMD EPYC eager stock
    # 63.04%, plugin 64.97% (identical text, 6 prompts: 74.60 / 74.20%), compiled stock 58.68%, plugin
    # 59.36% (7 prompts: 65.43 / 65.43%)
    assert all_atom >= all_stock - ACCEPTANCE_MARGIN, (
        f"k={k} {tag} over all prompts, each alone: plugin {all_atom:.4f} < stock {all_stock:.4f} - "
        f"{ACCEPTANCE_MARGIN}"
    )
    assert len(atom_batch["spec"]["accepted_per_pos"]) == k


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


for _impl in ("stock", "plugin"):
    plan(
        f"bf16_{_impl}_k3_per_prompt",
        lambda p=_impl == "plugin": spec(plugin=p, dtype="bfloat16", k=3, jobs=per_prompt_jobs()),
    )


@vllm_runs("bf16_stock_k3_per_prompt", "bf16_plugin_k3_per_prompt")
def test_bf16_k3_acceptance_on_identical_text_not_below_stock() -> None:
    stock = engine_run("bf16_stock_k3_per_prompt")["jobs"]
    atom = engine_run("bf16_plugin_k3_per_prompt")["jobs"]
    common, on_stock, on_atom, all_stock, all_atom = _identical_text_rates(stock, atom)
    print(
        f"k=3, {len(common)} of 16 prompts with identical outputs: stock {on_stock:.4f}, plugin {on_atom:.4f}; "
        f"all prompts: stock {all_stock:.4f}, plugin {all_atom:.4f}"
    )
    assert len(common) >= MIN_COMMON_PROMPTS, f"only {len(common)} prompts with identical outputs: {common}"
    assert on_atom >= on_stock - ACCEPTANCE_MARGIN, (
        f"k=3 on identical text: plugin {on_atom:.4f} < stock {on_stock:.4f} - {ACCEPTANCE_MARGIN}"
    )
