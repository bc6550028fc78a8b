"""Stock vLLM vs vLLM + ATOM plugin: MTP speculative decoding on the same prompts, same process tree.

For each implementation (stock: ATOM_DISABLE_VLLM_PLUGIN=1; atom: the plugin) and each k in --ks, one
vLLM engine (a fresh child process, via tests/_harness.py) generates prompts.json's 16 prompts
(128 greedy tokens each, ignore_eos) and reports output tokens/s (wall time of the generate call), the
acceptance rate (accepted / drafted tokens), the mean acceptance length (1 + accepted / drafts) and the
per-position acceptance (accepted at position i / drafts). Results go to
benchmarks/results/vllm_spec_decode.json (+ .png when matplotlib is installed: uv sync --extra bench).

    uv run python benchmarks/vllm_spec_decode.py                # bf16, k = 0..4, both implementations
    uv run python benchmarks/vllm_spec_decode.py --ks 1 3 --dtype float32 --impls atom
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "tests"))


def _model_dir() -> Path:
    from atom_core.paths import default_model_dir

    return default_model_dir()


def _prompts() -> tuple[list[list[int]], int]:
    from atom_core.paths import reference_dir

    raw = json.loads((reference_dir() / "prompts.json").read_text())
    return [x["prompt_token_ids"] for x in raw["prompts"]], int(raw["max_tokens"])


def run_one(impl: str, k: int, dtype: str, eager: bool, workdir: Path) -> dict[str, Any]:
    from _harness import run

    prompts, max_tokens = _prompts()
    spec = {
        "model": str(_model_dir()),
        "plugin": impl == "atom",
        "dtype": dtype,
        "num_speculative_tokens": k,
        "enforce_eager": eager,
        "jobs": [
            # a short warm-up job first, so the timed job does not pay one-off first-step costs
            {"name": "warmup", "prompt_token_ids": prompts[:2], "max_tokens": 8},
            {"name": "timed", "prompt_token_ids": prompts, "max_tokens": max_tokens},
        ],
    }
    r = run(spec, str(workdir), timeout=1800, log_name=f"{impl}_k{k}_{dtype}")
    row: dict[str, Any] = {"impl": impl, "k": k, "dtype": dtype, "enforce_eager": eager, "log": r.get("log")}
    if "error" in r:
        row["error"] = r["error"]
        return row
    job = r["jobs"]["timed"]
    row.update(
        startup_s=r["startup_s"],
        wall_s=job["wall_s"],
        output_tokens=job["output_tokens"],
        output_tokens_per_s=job["output_tokens_per_s"],
        acceptance_rate=job["acceptance_rate"],
        mean_acceptance_length=job["mean_acceptance_length"],
        per_position_rate=job["per_position_rate"],
        spec_counters=job["spec"],
        token_ids=job["token_ids"],
    )
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"[plot] matplotlib is not installed (uv sync --all-packages --extra cpu --extra bench); {path.name} not written"
        )
        return False
    ok = [r for r in rows if "error" not in r]
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    ks = sorted({r["k"] for r in ok})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / max(len(impls), 1)
    for j, impl in enumerate(impls):
        by_k = {r["k"]: r for r in ok if r["impl"] == impl}
        xs = [i + j * width for i in range(len(ks))]
        axes[0].bar(xs, [by_k[k]["output_tokens_per_s"] if k in by_k else 0 for k in ks], width, label=impl)
        spec_ks = [k for k in ks if k > 0 and k in by_k]
        axes[1].plot(
            spec_ks, [by_k[k]["acceptance_rate"] for k in spec_ks], "o-", label=f"{impl} acceptance rate"
        )
        axes[1].plot(
            spec_ks,
            [by_k[k]["mean_acceptance_length"] - 1 for k in spec_ks],
            "s--",
            label=f"{impl} mean len - 1",
        )
        for k in spec_ks:
            pos = by_k[k]["per_position_rate"]
            axes[2].plot(
                range(1, len(pos) + 1), pos, "o-" if impl == "atom" else "x--", label=f"{impl} k={k}"
            )
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(ks))], [f"k={k}" for k in ks])
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput (16 prompts x 128 tokens)")
    axes[1].set_xlabel("num_speculative_tokens")
    axes[1].set_title("acceptance")
    axes[2].set_xlabel("draft position")
    axes[2].set_ylabel("accepted / drafts")
    axes[2].set_title("per-position acceptance")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"vLLM 0.32 CPU, tiny Qwen3-Next MTP, {ok[0]['dtype'] if ok else ''}: stock vs ATOM plugin",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (stock vLLM CPU GDN needs it) or float32")
    ap.add_argument("--impls", nargs="+", default=["stock", "atom"], choices=["stock", "atom"])
    ap.add_argument(
        "--compiled", action="store_true", help="vLLM's default compilation instead of enforce_eager"
    )
    ap.add_argument("--out", default=str(RESULTS / "vllm_spec_decode.json"))
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="vllm_spec_decode_"))  # engine logs (paths in the JSON rows)
    rows = []
    t0 = time.time()
    for k in args.ks:
        for impl in args.impls:
            row = run_one(impl, k, args.dtype, not args.compiled, workdir)
            rows.append(row)
            if "error" in row:
                print(f"{impl:5s} k={k}: ERROR {row['error']} (log {row['log']})", flush=True)
                continue
            print(
                f"{impl:5s} k={k}: {row['output_tokens_per_s']:7.1f} tok/s  acceptance "
                f"{row['acceptance_rate'] if row['acceptance_rate'] is not None else float('nan'):.3f}  mean len "
                f"{row['mean_acceptance_length'] or 1.0:.3f}  per pos {[round(x, 3) for x in row['per_position_rate']]}",
                flush=True,
            )
    ratios = {}
    for k in args.ks:
        s = next((r for r in rows if r["impl"] == "stock" and r["k"] == k and "error" not in r), None)
        a = next((r for r in rows if r["impl"] == "atom" and r["k"] == k and "error" not in r), None)
        if s and a:
            ratios[f"k={k}"] = {
                "tokens_per_s_atom_over_stock": a["output_tokens_per_s"] / s["output_tokens_per_s"],
                "acceptance_atom_minus_stock": None
                if k == 0
                else a["acceptance_rate"] - s["acceptance_rate"],
                "same_outputs": a["token_ids"] == s["token_ids"],
            }
    payload = {
        "benchmark": "vllm_spec_decode",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "args": vars(args),
        "total_s": time.time() - t0,
        "rows": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
        "atom_vs_stock": ratios,
    }
    out.write_text(json.dumps(payload, indent=1))
    print(json.dumps(ratios, indent=1))
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
