"""The lm-eval verification path as a benchmark: lm-eval (``--model local-completions``) against vLLM's
OpenAI server serving the tiny Qwen3-Next with MTP, ATOM plugin on vs stock vLLM (plugin off).

For each implementation, one server (``python -m vllm.entrypoints.openai.api_server``, bf16, eager, MTP
k = 1 by default) and one lm_eval CLI run (HF_HUB_OFFLINE=1, num_concurrent=8) on the local task
``stdlib_next_line`` (tests/lm_eval_task: 40 next-line completions of CPython 3.11 stdlib modules, exact
match, greedy until "\\n"); spec-decode counters from the server's /metrics. The servers run one after the
other. Results (scores, acceptance, counters, which lines each got right, timings) go to
benchmarks/results/vllm_lm_eval.json.

    uv run python benchmarks/vllm_lm_eval.py                   # atom then stock, k = 1
    uv run python benchmarks/vllm_lm_eval.py --impls atom --k 2
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "tests"))

from _lm_eval import TASK, evaluate, table, task_size  # noqa: E402


def _model_dir() -> Path:
    from atom_core.paths import default_model_dir

    return default_model_dir()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", nargs="+", choices=["atom", "stock"], default=["atom", "stock"])
    ap.add_argument("--k", type=int, default=1, help="num_speculative_tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=RESULTS / "vllm_lm_eval.json")
    args = ap.parse_args()
    if args.k < 1:
        ap.error(f"--k must be >= 1 (MTP drafts at least one token), got {args.k}")

    model = _model_dir()
    runs = []
    with tempfile.TemporaryDirectory(prefix="atom-lm-eval-") as tmp:
        for impl in args.impls:
            t0 = time.time()
            try:
                r = evaluate(model, plugin=impl == "atom", workdir=Path(tmp), k=args.k, dtype=args.dtype)
            except RuntimeError as e:
                print(f"[{impl}] failed: {e}", file=sys.stderr)
                return 1
            r["wall_s"] = round(time.time() - t0, 1)
            r.pop("server_log")
            r["outputs"] = {str(i): v for i, v in sorted(r["outputs"].items())}
            runs.append(r)
            print(
                f"[{impl}] exact match {r['exact_match']:.3f}, acceptance {r['acceptance']:.1%}, {r['wall_s']} s"
            )
    print(table(runs))
    out = {
        "what": "lm_eval local-completions vs vLLM OpenAI server (MTP), ATOM plugin on/off",
        "task": TASK,
        "n_items": task_size(),
        "model": str(model.relative_to(REPO)) if model.is_relative_to(REPO) else str(model),
        "k": args.k,
        "dtype": args.dtype,
        "lm_eval_model_args": "num_concurrent=8,tokenized_requests=False,tokenizer_backend=huggingface",
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
