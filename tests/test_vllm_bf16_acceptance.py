"""bfloat16 through vLLM: ATOM plugin vs stock vLLM (ATOM_DISABLE_VLLM_PLUGIN=1) on prompts.json.

Same prompts, same dtype, same engine settings, same test session: the plugin's MTP acceptance rate must
not be lower than stock's minus 2 points, and its greedy consistency against the float32 reference
(teacher-forced, see _reference.py) no worse than stock's beyond bf16 near-tie noise.
"""

from __future__ import annotations

import pytest
from _reference import consistency
from _vllm import engine_run, model_dir, prompt_set, prompts_job, requires_vllm, spec

pytestmark = [requires_vllm, pytest.mark.slow]

ACCEPTANCE_MARGIN = 0.02  # the bar: plugin >= stock - 2 points
# Greedy consistency: the plugin may emit a few more near-tie tokens than stock (bf16 rounding differs
# between implementations), but no token far from the float32 argmax. Stock bf16 eager measured on this
# fixture (README): 18 of 2048 off-argmax with MTP, largest gap 1.59 logits.
EXTRA_OFF_ARGMAX = 8
MAX_GAP_SLACK = 0.5


def _runs(k: int, enforce_eager: bool = True):
    tag = "eager" if enforce_eager else "compiled"
    stock = engine_run(
        spec(plugin=False, dtype="bfloat16", k=k, jobs=[prompts_job()], enforce_eager=enforce_eager),
        f"bf16_stock_k{k}_{tag}",
    )
    atom = engine_run(
        spec(plugin=True, dtype="bfloat16", k=k, jobs=[prompts_job()], enforce_eager=enforce_eager),
        f"bf16_plugin_k{k}_{tag}",
    )
    return stock["jobs"]["prompts"], atom["jobs"]["prompts"]


@pytest.mark.parametrize(
    ("k", "eager"), [(1, True), (3, True), (1, False)], ids=["k1-eager", "k3-eager", "k1-compiled"]
)
def test_bf16_acceptance_not_below_stock(k: int, eager: bool) -> None:
    stock, atom = _runs(k, eager)
    print(
        f"k={k}: stock {stock['spec']} rate {stock['acceptance_rate']:.4f}; plugin {atom['spec']} rate {atom['acceptance_rate']:.4f}"
    )
    assert atom["acceptance_rate"] >= stock["acceptance_rate"] - ACCEPTANCE_MARGIN, (
        f"k={k}: plugin acceptance {atom['acceptance_rate']:.4f} < stock {stock['acceptance_rate']:.4f} - "
        f"{ACCEPTANCE_MARGIN}"
    )
    assert len(atom["spec"]["accepted_per_pos"]) == k


@pytest.mark.parametrize(("k", "eager"), [(1, True), (1, False)], ids=["k1-eager", "k1-compiled"])
def test_bf16_greedy_consistency_not_worse_than_stock(k: int, eager: bool) -> None:
    stock, atom = _runs(k, eager)
    prompts, _ = prompt_set()
    c_stock = consistency(str(model_dir()), prompts, stock["token_ids"])
    c_atom = consistency(str(model_dir()), prompts, atom["token_ids"])
    print(f"k={k}: stock {c_stock}; plugin {c_atom}")
    assert c_atom.off_argmax <= c_stock.off_argmax + EXTRA_OFF_ARGMAX, (c_atom, c_stock)
    assert c_atom.max_gap <= c_stock.max_gap + MAX_GAP_SLACK, (c_atom, c_stock)
