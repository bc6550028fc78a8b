"""Run one offline vLLM configuration in a fresh process and report JSON (a helper of tests/ and benchmarks/,
not shipped: tests import it as ``_harness``, benchmarks put ``tests/`` on ``sys.path`` first).

vLLM's ``LLM(...)`` spawns its engine process, so it must be created under ``__main__`` of a process of
its own; tests and benchmarks therefore call :func:`run` (which starts ``python tests/_harness.py``)
rather than building ``LLM`` in-process. One spec = one engine start; a spec can run several prompt sets.

Spec (JSON): ``model``, ``plugin`` (bool: False sets ATOM_DISABLE_VLLM_PLUGIN=1), ``dtype``,
``num_speculative_tokens`` (0 = no speculative decoding), ``enforce_eager``, ``max_model_len``,
``tensor_parallel_size``, ``env`` (extra environment), ``llm_kwargs`` (extra LLM arguments),
``collect_rank_state`` (bool: also report, per worker rank, the models' parameters and the cache tensors
vLLM bound to each layer, see :func:`_rank_state`) and ``jobs``: a list of
``{"name", "prompt_token_ids": [[...], ...], "max_tokens", "profile"}`` (``profile``: optional bool, wrap
the job in ``LLM.start_profile`` / ``stop_profile``; needs ``llm_kwargs["profiler_config"]``), or a
conversation job ``{"name", "turns": [[new ids of conversation 0, 1, ...], ...], "max_tokens"}``: turn ``t``
of conversation ``j`` is its previous turn's prompt and output followed by ``turns[t][j]`` (an empty list:
the conversation sits the turn out; ``{"repeat": i, "turn": u}``: conversation ``i``'s prompt of turn
``u``, again); each turn's requests run as one batch, turn after turn. A job with ``"repeat": n`` runs its
prompts ``n`` times one after the other and reports each run's wall time and cached prompt tokens.
Result: per job the generated token ids, wall time and output tokens/s, plus the spec-decode counters
(``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_pos``) accumulated over
that job, and the engine start-up time; or ``{"error": ...}`` with the exception text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

SPEC_METRICS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
    "vllm:num_preemptions": "num_preemptions",
}


def _spec_counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_pos": [],
        "num_preemptions": 0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
    }
    for m in llm.get_metrics():
        key = SPEC_METRICS.get(m.name)
        if key is None:
            continue
        if key == "accepted_per_pos":
            out[key] = [int(v) for v in m.values]
        else:
            out[key] += int(m.value)
    return out


def _diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    per_pos_b = before["accepted_per_pos"] + [0] * (
        len(after["accepted_per_pos"]) - len(before["accepted_per_pos"])
    )
    d = {
        k: after[k] - before[k]
        for k in (
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "num_preemptions",
            "prefix_cache_queries",
            "prefix_cache_hits",
        )
    }
    d["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], per_pos_b)]
    return d


def summarize(counters: dict[str, Any]) -> dict[str, float | None]:
    """Acceptance rate (accepted / drafted tokens) and mean acceptance length (1 + accepted / drafts)."""
    drafts, drafted, accepted = (
        counters["num_drafts"],
        counters["num_draft_tokens"],
        counters["num_accepted_tokens"],
    )
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_rate": [a / drafts for a in counters["accepted_per_pos"]] if drafts else [],
    }


def _rank_state(worker: Any) -> dict[str, Any]:
    """On one worker (through ``LLM.collective_rpc``): its TP rank, every parameter of the target and of
    the draft (shape, dtype, bytes, float64 sum: shards of different ranks differ) and the shapes / dtypes of
    the cache tensors vLLM bound to each layer of its forward context."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    runner = worker.model_runner

    def params(model: Any) -> dict[str, Any]:
        return {
            name: {
                "shape": list(p.shape),
                "dtype": str(p.dtype),
                "bytes": p.numel() * p.element_size(),
                "sum": float(p.detach().double().sum()),
            }
            for name, p in model.named_parameters()
        }

    def tensors(cache: Any) -> list[Any]:
        if isinstance(cache, torch.Tensor):
            return [{"shape": list(cache.shape), "dtype": str(cache.dtype)}]
        if isinstance(cache, (list, tuple)):
            return [t for c in cache for t in tensors(c)]
        return []

    drafter = getattr(runner, "drafter", None)
    ctx = runner.vllm_config.compilation_config.static_forward_context
    return {
        "rank": get_tensor_model_parallel_rank(),
        "target": params(runner.model),
        "draft": params(drafter.model) if drafter is not None and hasattr(drafter, "model") else {},
        "caches": {name: tensors(getattr(layer, "kv_cache", None)) for name, layer in ctx.items()},
        "block_size": runner.vllm_config.cache_config.block_size,
    }


def _main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict[str, Any] = {"spec": {k: v for k, v in spec.items() if k != "jobs"}}
    try:
        from vllm import LLM, SamplingParams

        kwargs: dict[str, Any] = {
            "model": spec["model"],
            "dtype": spec.get("dtype", "float32"),
            "enforce_eager": spec.get("enforce_eager", True),
            "enable_prefix_caching": False,
            "disable_log_stats": False,
            "max_model_len": spec.get("max_model_len", 512),
            "tensor_parallel_size": spec.get("tensor_parallel_size", 1),
            "seed": 0,
            # One worker process beside an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0, set
            # by run()): measured here, 1m08 per run vs 2m24 with the default three processes (each
            # imports vLLM) and vs slow decoding with the "uni" executor (OpenMP needs its own process).
            "distributed_executor_backend": "mp",
        }
        k = spec.get("num_speculative_tokens", 0)
        if k:
            kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        kwargs.update(spec.get("llm_kwargs", {}))
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["startup_s"] = time.perf_counter() - t0
        if spec.get("collect_rank_state"):
            result["ranks"] = llm.collective_rpc(_rank_state)
        result["jobs"] = {}
        for job in spec["jobs"]:
            params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
            if "turns" in job:
                result["jobs"][job["name"]] = _conversation(llm, job, params)
                continue
            if "repeat" in job:
                result["jobs"][job["name"]] = _repeat(llm, job, SamplingParams)
                continue
            prompts = [{"prompt_token_ids": ids} for ids in job["prompt_token_ids"]]
            before = _spec_counters(llm)
            if job.get("profile"):
                llm.start_profile()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            if job.get("profile"):
                llm.stop_profile()
            counters = _diff(_spec_counters(llm), before)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            n_out = sum(len(t) for t in tokens)
            result["jobs"][job["name"]] = {
                "token_ids": tokens,
                "wall_s": wall,
                "output_tokens": n_out,
                "output_tokens_per_s": n_out / wall if wall > 0 else None,
                "spec": counters,
                **summarize(counters),
            }
    except Exception as e:  # reported to the parent, which decides what a failure means
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(result, f)


def _repeat(llm: Any, job: dict[str, Any], sampling_params: Any) -> dict[str, Any]:
    """Run a repeat job: the same prompts ``repeat`` times, one after the other, ``max_tokens`` each (1:
    the wall time is the time to the first token); per run the wall time and cached prompt tokens."""
    params = sampling_params(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in job["prompt_token_ids"]]
    runs = []
    for _ in range(job["repeat"]):
        before = _spec_counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        counters = _diff(_spec_counters(llm), before)
        runs.append(
            {
                "wall_s": wall,
                "num_cached_tokens": [o.num_cached_tokens for o in outs],
                "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                "prefix_cache_hits": counters["prefix_cache_hits"],
            }
        )
    return {"runs": runs}


def _conversation(llm: Any, job: dict[str, Any], params: Any) -> dict[str, Any]:
    """Run a conversation job (see the module docstring): per turn the prompts, outputs, wall time and the
    counters of that turn (prefix-cache queries / hits included)."""
    history: dict[int, list[int]] = {}
    prompts_of: list[dict[int, list[int]]] = []
    turns = []
    for new in job["turns"]:
        convs = [j for j, ids in enumerate(new) if ids]
        prompts = [
            list(prompts_of[new[j]["turn"]][new[j]["repeat"]])
            if isinstance(new[j], dict)
            else history.get(j, []) + list(new[j])
            for j in convs
        ]
        prompts_of.append(dict(zip(convs, prompts)))
        before = _spec_counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        for j, p, t in zip(convs, prompts, tokens):
            history[j] = p + t
        counters = _diff(_spec_counters(llm), before)
        turns.append(
            {
                "conversations": convs,
                "prompt_token_ids": prompts,
                "token_ids": tokens,
                "num_cached_tokens": [o.num_cached_tokens for o in outs],
                "wall_s": wall,
                "spec": counters,
                **summarize(counters),
            }
        )
    return {"turns": turns, "wall_s": sum(t["wall_s"] for t in turns)}


def run(
    spec: dict[str, Any],
    workdir: str,
    timeout: float = 900,
    log_name: str | None = None,
    env: dict[str, str] | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
) -> dict[str, Any]:
    """Run ``spec`` in a fresh ``python tests/_harness.py`` process; return its JSON result.

    ``env``: environment for the process under the spec's own ``env`` (e.g. the CPU cores to bind).
    ``on_start(proc)``: called with the process once started (to stop it from elsewhere).
    The process's combined output goes to ``<workdir>/<log_name>.log`` (kept for debugging).
    """
    os.makedirs(workdir, exist_ok=True)
    name = log_name or f"run{abs(hash(json.dumps(spec, sort_keys=True, default=str))) % 10**8}"
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    out_path = os.path.join(workdir, f"{name}.result.json")
    log_path = os.path.join(workdir, f"{name}.log")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    proc_env = dict(os.environ)
    proc_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc_env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    proc_env["ATOM_DISABLE_VLLM_PLUGIN"] = "0" if spec.get("plugin", True) else "1"
    proc_env.update(env or {})
    proc_env.update({k: str(v) for k, v in spec.get("env", {}).items()})
    if os.path.exists(out_path):
        os.remove(out_path)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), spec_path, out_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=proc_env,
        )
        if on_start is not None:
            on_start(proc)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    if not os.path.exists(out_path):
        with open(log_path) as f:
            tail = f.read()[-4000:]
        return {
            "error": f"harness exited with {proc.returncode} and no result",
            "log_tail": tail,
            "log": log_path,
        }
    with open(out_path) as f:
        result = json.load(f)
    result["log"] = log_path
    return result


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
