"""The lm-eval verification path: ``lm_eval --model local-completions`` against vLLM's OpenAI server.

:func:`evaluate` starts ``python -m vllm.entrypoints.openai.api_server`` on the tiny Qwen3-Next with MTP
(plugin on, or stock vLLM with ``ATOM_DISABLE_VLLM_PLUGIN=1``), runs lm-eval's CLI on the local task in
``tests/lm_eval_task`` (built by its ``make_task.py``) offline, reads the spec-decode counters from
``/metrics`` and stops the server. Shared by tests/test_vllm_lm_eval.py and benchmarks/vllm_lm_eval.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _server import ServerError, VllmServer, spec_counters

REPO = Path(__file__).resolve().parents[1]
TASK_DIR = REPO / "tests" / "lm_eval_task"
TASK = "stdlib_next_line"


def task_size() -> int:
    with open(TASK_DIR / f"{TASK}.jsonl", encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def evaluate(
    model: Path,
    *,
    plugin: bool,
    workdir: Path,
    k: int = 1,
    dtype: str = "bfloat16",
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One server start + one lm_eval run. Raises RuntimeError (with the logs' tails) on any failure.
    ``env``: extra environment of the server (e.g. its CPU cores)."""
    impl = "atom" if plugin else "stock"
    workdir.mkdir(parents=True, exist_ok=True)
    args = [
        "--dtype", dtype, "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "2048",
        "--max-num-seqs", "8", "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k}),
    ]  # fmt: skip
    server = VllmServer(
        model,
        args,
        plugin=plugin,
        log=workdir / f"server_{impl}.log",
        env={"HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=timeout,
    )
    try:
        server.start()
    except ServerError as e:
        raise RuntimeError(f"{impl} server: {e}") from None
    try:
        t_up = time.time()
        out_dir = workdir / f"lm_eval_{impl}"
        lm_cmd = [
            sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model={model},base_url={server.base}/v1/completions,num_concurrent=8,tokenized_requests=False,"
            "tokenizer_backend=huggingface",
            "--include_path", str(TASK_DIR), "--tasks", TASK, "--output_path", str(out_dir), "--log_samples",
        ]  # fmt: skip
        lm_log = workdir / f"lm_eval_{impl}.log"
        with open(lm_log, "w") as log:
            # data_files in the task YAML is relative to the task folder
            rc = subprocess.run(
                lm_cmd, cwd=TASK_DIR, env=server.env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        t_eval = time.time() - t_up
        if rc != 0:
            raise RuntimeError(f"lm_eval ({impl}) exited with {rc}:\n{_tail(lm_log)}")
        counters = spec_counters(server.metrics())
        plugin_active = "ATOM vLLM plugin active" in server.log_text()
    finally:
        server.stop()
    results_files = sorted(out_dir.rglob("results_*.json"))
    samples_files = sorted(out_dir.rglob(f"samples_{TASK}_*.jsonl"))
    if not results_files or not samples_files:
        raise RuntimeError(f"lm_eval ({impl}) wrote no results/samples under {out_dir}:\n{_tail(lm_log)}")
    res = json.loads(results_files[-1].read_text())
    samples = [json.loads(line) for line in samples_files[-1].read_text().splitlines() if line.strip()]
    drafted, accepted, drafts = (
        counters["num_draft_tokens"],
        counters["num_accepted_tokens"],
        counters["num_drafts"],
    )
    return {
        "impl": impl,
        "plugin_active_in_log": plugin_active,
        "exact_match": float(res["results"][TASK]["exact_match,none"]),
        "n_samples": int(res["n-samples"][TASK]["effective"]),
        "n_scored": len(samples),
        "hits": sorted(int(s["doc"]["id"]) for s in samples if s["exact_match"]),
        "outputs": {int(s["doc"]["id"]): s["filtered_resps"][0] for s in samples},
        "spec_decode": counters,
        "acceptance": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "startup_s": round(server.startup_s, 1),
        "eval_s": round(t_eval, 1),
        "server_log": str(server.log_path),
    }


def table(runs: list[dict[str, Any]]) -> str:
    rows = [f"{'impl':<6} {'exact_match':>11} {'items':>5} {'drafted':>8} {'accepted':>8} {'acceptance':>10}"]
    for r in runs:
        sd = r["spec_decode"]
        rows.append(
            f"{r['impl']:<6} {r['exact_match']:>11.3f} {r['n_scored']:>5} "
            f"{int(sd['num_draft_tokens']):>8} {int(sd['num_accepted_tokens']):>8} {r['acceptance']:>10.1%}"
        )
    return "\n".join(rows)
