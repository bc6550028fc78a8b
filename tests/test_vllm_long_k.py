"""k = 5..8 speculative tokens, float32, through vLLM with the ATOM plugin: greedy.json reproduced exactly.

The plugin's deferred-commit verify keeps one committed GDN state and 1 + k pending tokens per sequence, so
a long draft changes the verify width only. All k values run in ONE process (:mod:`_k_sweep`: one engine
per k, vLLM imported once). CI runs ``ATOM_VLLM_LONG_KS`` (default ``"5 8"``: the smallest k that crashes
stock vLLM's GDN path on GPUs (vLLM #37035) and the plugin's cap, ``atom_core.MAX_SPECULATIVE_TOKENS``);
``ATOM_VLLM_LONG_KS="5 6 7 8"`` runs them all. Acceptance per draft position is printed.
"""

from __future__ import annotations

import os

import pytest
from _k_sweep import run_ks
from _vllm import WORKDIR, greedy_differences, model_dir, requires_vllm

pytestmark = [requires_vllm, pytest.mark.slow]

KS = [int(k) for k in os.environ.get("ATOM_VLLM_LONG_KS", "5 8").split()]
# The first draft position is the k = 1 draft (measured 0.70 at k = 5..7 on greedy.json, 0.72 at k = 1);
# below half of that the draft is broken.
MIN_FIRST_POSITION = 0.35


@pytest.fixture(scope="module")
def sweep() -> dict:
    r = run_ks(model=str(model_dir()), plugin=True, dtype="float32", ks=KS, workdir=str(WORKDIR),
               log_name="f32_plugin_long_k")  # fmt: skip
    if "error" in r:
        pytest.fail(f"k sweep failed: {r['error']}\n{r.get('log_tail', '')[-3000:]}")
    return r


@pytest.mark.parametrize("k", KS)
def test_long_draft_reproduces_greedy(sweep, k: int) -> None:
    run = sweep["ks"][str(k)]
    assert "error" not in run, f"k={k}: {run['error']}\n{run.get('traceback', '')[-3000:]}"
    bad = greedy_differences(run["token_ids"])
    assert not bad, f"float32 k={k} output differs from greedy.json:\n" + "\n".join(bad)
    per_pos = run["per_position_rate"]
    print(f"\nk={k}: acceptance {run['acceptance_rate']:.3f}, mean acceptance length "
          f"{run['mean_acceptance_length']:.2f}, per position {[round(p, 3) for p in per_pos]} ({run['spec']})")  # fmt: skip
    assert len(per_pos) == k, f"k={k}: accepted counts for {len(per_pos)} positions"
    assert per_pos[0] >= MIN_FIRST_POSITION, f"k={k}: first-position acceptance {per_pos[0]:.3f}"
    # a position is accepted only after every earlier one: the counts never rise along the draft
    counts = run["spec"]["accepted_per_pos"]
    assert all(a >= b for a, b in zip(counts, counts[1:])), counts
