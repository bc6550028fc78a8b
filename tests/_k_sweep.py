"""Several ``num_speculative_tokens`` values through vLLM's offline ``LLM`` in ONE process (a helper of tests/).

Each k needs its own engine (the speculative config is fixed at engine start), but the process's vLLM
import (most of a :mod:`_harness` run's fixed cost on the 2-core CI machine) is paid once: the engines are
built one after the other, each shut down (its engine core, then vLLM's distributed state) before the next.
Every engine gets the greedy.json prompts (64 greedy tokens each, ``ignore_eos``).

Spec (JSON): ``model``, ``plugin`` (bool), ``dtype``, ``ks`` (list of k >= 1), ``llm_kwargs`` (extra ``LLM``
arguments). Result: per k (as a string key) the generated token ids, the engine start-up and generation
times, the spec-decode counters and their summary (:func:`_harness.summarize`), or ``{"error": ...}`` with
the exception text when that engine failed (the next k still runs).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any


def _one_k(spec: dict[str, Any], k: int, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    from _harness import _diff, _spec_counters, summarize
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": spec["dtype"],
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "disable_log_stats": False,
        "max_model_len": 512,
        "seed": 0,
        "distributed_executor_backend": "mp",
        "speculative_config": {"method": "mtp", "num_speculative_tokens": k},
        **spec.get("llm_kwargs", {}),
    }
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    try:
        before = _spec_counters(llm)
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        counters = _diff(_spec_counters(llm), before)
        return {
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "startup_s": startup,
            "wall_s": wall,
            "spec": counters,
            **summarize(counters),
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def _main(spec_path: str, out_path: str) -> None:
    from _vllm import greedy_cases
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with open(spec_path) as f:
        spec = json.load(f)
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in greedy_cases()]
    result: dict[str, Any] = {"spec": spec, "ks": {}}
    for k in spec["ks"]:
        try:
            result["ks"][str(k)] = _one_k(spec, int(k), prompts)
        except Exception as e:  # reported per k; the parent decides what a failure means
            result["ks"][str(k)] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        cleanup_dist_env_and_memory()
        gc.collect()
        with open(out_path, "w") as f:  # written after every k: a later crash keeps the earlier results
            json.dump(result, f)


def run_ks(
    *, model: str, plugin: bool, dtype: str, ks: list[int], workdir: str, log_name: str,
    llm_kwargs: dict[str, Any] | None = None, timeout: float = 1800,
) -> dict[str, Any]:  # fmt: skip
    """Run the greedy.json prompts for every k of ``ks`` in one fresh process; return its JSON result
    (``{"error": ..., "log_tail": ...}`` when the process wrote none). The log is ``<workdir>/<log_name>.log``."""
    os.makedirs(workdir, exist_ok=True)
    spec = {"model": model, "plugin": plugin, "dtype": dtype, "ks": ks, "llm_kwargs": llm_kwargs or {}}
    spec_path = os.path.join(workdir, f"{log_name}.spec.json")
    out_path = os.path.join(workdir, f"{log_name}.result.json")
    log_path = os.path.join(workdir, f"{log_name}.log")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if os.path.exists(out_path):
        os.remove(out_path)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env["ATOM_DISABLE_VLLM_PLUGIN"] = "0" if plugin else "1"
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), spec_path, out_path],
            stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout,
        )  # fmt: skip
    if not os.path.exists(out_path):
        with open(log_path) as f:
            return {"error": f"exited with {proc.returncode} and no result", "log_tail": f.read()[-4000:]}
    with open(out_path) as f:
        result = json.load(f)
    result["log"] = log_path
    missing = [k for k in ks if str(k) not in result["ks"]]
    if missing:
        with open(log_path) as f:
            result["error"] = f"exited with {proc.returncode} before k = {missing}"
            result["log_tail"] = f.read()[-4000:]
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _main(sys.argv[1], sys.argv[2])
