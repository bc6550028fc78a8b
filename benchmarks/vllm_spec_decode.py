"""Stock vLLM vs vLLM + ATOM plugin: MTP speculative decoding on the same prompts, same process tree.

For each mode (eager: enforce_eager; compiled: vLLM's default compilation), each k in --ks and each
implementation (stock: ATOM_DISABLE_VLLM_PLUGIN=1; atom: the plugin), one vLLM engine (a fresh child
process, via tests/_harness.py) runs one timed job per concurrency c in --concurrency: c requests submitted
at once (prompts.json's 16 prompts, cycled), greedy, ignore_eos, 128 tokens each (32 at c >= 256, see
--max-tokens-256); at c = 1, SINGLE_STREAMS single-request jobs one after the other (prompts 0, 1, ...),
pooled (one request lasts about a second, and its acceptance is one text's). Reported per row: output
tokens/s (wall time of the generate calls), the acceptance rate (accepted / drafted tokens), the mean
acceptance length (1 + accepted / drafts) and the per-position acceptance. Results go to benchmarks/results/vllm_spec_decode.json, rewritten after every engine run
(+ .png when matplotlib is installed: uv sync --extra bench).

``--rounds R`` runs the whole matrix R times, the modes in reverse order every other round, each engine fresh:
on these shared 2-core machines two engines of the same tree have differed by up to 45% in a c = 256 job,
more than most effects measured with them. The summaries pair rows of the same round and report each
round's ratio and the median (``atom_vs_stock``: plugin over stock per mode, k, c; ``compiled_vs_eager``:
per implementation, k, c); the plot shows the median tokens/s of each cell.

    uv run python benchmarks/vllm_spec_decode.py       # bf16, eager + compiled, k = 0 1 3, c = 1 16 256
    uv run python benchmarks/vllm_spec_decode.py --modes compiled --ks 1 --concurrency 1 16 --impls atom
    uv run python benchmarks/vllm_spec_decode.py --impls atom --ks 1 3 --concurrency 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
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


SINGLE_STREAMS = 8
"""Single-request jobs (prompts 0 .. SINGLE_STREAMS - 1) pooled into the c = 1 row."""


def _concurrency_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` prompts: prompts.json's, cycled (256 = 16 copies of the 16 prompts)."""
    return [prompts[i % len(prompts)] for i in range(n)]


def _jobs_of(c: int, prompts: list[list[int]]) -> list[tuple[str, list[list[int]]]]:
    """The timed jobs of concurrency ``c`` (name, prompts): one batch of ``c`` requests, or at c = 1
    :data:`SINGLE_STREAMS` single-request jobs."""
    if c == 1:
        return [(f"c1_{i}", [prompts[i % len(prompts)]]) for i in range(SINGLE_STREAMS)]
    return [(f"c{c}", _concurrency_prompts(prompts, c))]


def _pooled(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's figures from jobs run one after the other: tokens over summed wall time, acceptance from
    the summed spec-decode counters."""
    if len(jobs) == 1:
        return jobs[0]
    from _harness import summarize

    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    counters: dict[str, Any] = {key: sum(j["spec"][key] for j in jobs) for key in keys}
    per_pos = [j["spec"]["accepted_per_pos"] for j in jobs if j["spec"]["accepted_per_pos"]]
    counters["accepted_per_pos"] = [sum(col) for col in zip(*per_pos)] if per_pos else []
    wall = sum(j["wall_s"] for j in jobs)
    tokens = sum(j["output_tokens"] for j in jobs)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "spec": counters,
        "token_ids": [t for j in jobs for t in j["token_ids"]],
        **summarize(counters),
    }


def run_one(
    impl: str,
    k: int,
    dtype: str,
    eager: bool,
    workdir: Path,
    concurrency: list[int],
    max_tokens_for: dict[int, int],
) -> list[dict[str, Any]]:
    """One engine (impl, k, eager/compiled); the timed jobs of each concurrency c (:func:`_jobs_of`: c
    requests submitted at once, or at c = 1 single streams one after the other), each request
    ``max_tokens_for[c]`` greedy tokens. One row per c."""
    from _harness import run

    prompts, _ = _prompts()
    mode = "eager" if eager else "compiled"
    spec = {
        "model": str(_model_dir()),
        "plugin": impl == "atom",
        "dtype": dtype,
        "num_speculative_tokens": k,
        "enforce_eager": eager,
        "llm_kwargs": {"max_num_seqs": max(256, max(concurrency))},
        "jobs": [
            # a short warm-up job first, so the timed jobs do not pay one-off first-step costs
            {"name": "warmup", "prompt_token_ids": prompts[:2], "max_tokens": 8},
        ]
        + [
            {"name": name, "prompt_token_ids": ids, "max_tokens": max_tokens_for[c]}
            for c in concurrency
            for name, ids in _jobs_of(c, prompts)
        ],
    }
    r = run(spec, str(workdir), timeout=3600, log_name=f"{impl}_k{k}_{dtype}_{mode}")
    rows = []
    for c in concurrency:
        row: dict[str, Any] = {
            "impl": impl,
            "k": k,
            "dtype": dtype,
            "mode": mode,
            "enforce_eager": eager,
            "concurrency": c,
            "max_tokens": max_tokens_for[c],
            "log": r.get("log"),
        }
        if "error" in r:
            row["error"] = r["error"]
            rows.append(row)
            continue
        job = _pooled([r["jobs"][name] for name, _ in _jobs_of(c, prompts)])
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
        rows.append(row)
    return rows


def _cell(rows: list[dict[str, Any]], impl: str, mode: str, k: int, c: int) -> list[dict[str, Any]]:
    """The rows of one cell (every round), errors left out."""
    return [
        r
        for r in rows
        if r["impl"] == impl
        and r["mode"] == mode
        and r["k"] == k
        and r["concurrency"] == c
        and "error" not in r
    ]


def _per_round(num: list[dict[str, Any]], den: list[dict[str, Any]]) -> list[float]:
    """tokens/s of ``num`` over ``den``, one ratio per round that both have."""
    by_round = {r["round"]: r for r in den}
    return [
        r["output_tokens_per_s"] / by_round[r["round"]]["output_tokens_per_s"]
        for r in num
        if r["round"] in by_round
    ]


def summarize(
    rows: list[dict[str, Any]], modes: list[str], ks: list[int], cs: list[int], impls: list[str]
) -> dict[str, dict[str, Any]]:
    """``atom_vs_stock`` per (mode, k, c) and ``compiled_vs_eager`` per (impl, k, c): each round's ratio of
    the two engines' tokens/s and their median (cells missing a side are left out)."""
    atom_vs_stock: dict[str, Any] = {}
    compiled_vs_eager: dict[str, Any] = {}
    for k in ks:
        for c in cs:
            for mode in modes:
                st, at = _cell(rows, "stock", mode, k, c), _cell(rows, "atom", mode, k, c)
                ratios = _per_round(at, st)
                if ratios:
                    atom_vs_stock[f"{mode} k={k} c={c}"] = {
                        "tokens_per_s_atom_over_stock": statistics.median(ratios),
                        "per_round": ratios,
                        "acceptance_atom_minus_stock": None
                        if k == 0
                        else at[0]["acceptance_rate"] - st[0]["acceptance_rate"],
                        "same_outputs": all(a["token_ids"] == s["token_ids"] for a in at for s in st),
                    }
            for impl in impls:
                comp, eager = _cell(rows, impl, "compiled", k, c), _cell(rows, impl, "eager", k, c)
                ratios = _per_round(comp, eager)
                if ratios:
                    compiled_vs_eager[f"{impl} k={k} c={c}"] = {
                        "median": statistics.median(ratios),
                        "per_round": ratios,
                        "compiled_tokens_per_s": [r["output_tokens_per_s"] for r in comp],
                        "eager_tokens_per_s": [r["output_tokens_per_s"] for r in eager],
                    }
    return {"atom_vs_stock": atom_vs_stock, "compiled_vs_eager": compiled_vs_eager}


def _median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell (impl, mode, k, c) holding the median tokens/s of its rounds."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            cells.setdefault((r["impl"], r["mode"], r["k"], r["concurrency"]), []).append(r)
    return [
        {**group[0], "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in group)}
        for group in cells.values()
    ]


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
    ok = _median_rows(rows)
    if not ok:
        return False
    modes = list(dict.fromkeys(r["mode"] for r in ok))
    cs = sorted({r["concurrency"] for r in ok})
    ks = sorted({r["k"] for r in ok})
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    fig, axes = plt.subplots(len(modes), len(cs), figsize=(4.2 * len(cs), 3.6 * len(modes)), squeeze=False)
    width = 0.8 / max(len(impls), 1)
    for mi, mode in enumerate(modes):
        for ci, c in enumerate(cs):
            ax = axes[mi][ci]
            for j, impl in enumerate(impls):
                by_k = {
                    r["k"]: r for r in ok if r["impl"] == impl and r["mode"] == mode and r["concurrency"] == c
                }
                xs = [i + j * width for i in range(len(ks))]
                ax.bar(
                    xs, [by_k[k]["output_tokens_per_s"] if k in by_k else 0 for k in ks], width, label=impl
                )
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ks))], [f"k={k}" for k in ks])
            ax.set_title(f"{mode}, concurrency {c}", fontsize=9)
            ax.set_ylabel("output tokens/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(
        f"vLLM 0.32 CPU, tiny Qwen3-Next MTP, {ok[0]['dtype']}: stock vs ATOM plugin, eager vs compiled",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (stock vLLM CPU GDN needs it) or float32")
    ap.add_argument("--impls", nargs="+", default=["stock", "atom"], choices=["stock", "atom"])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["eager", "compiled"],
        choices=["eager", "compiled"],
        help="enforce_eager, and/or vLLM's default compilation",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per request (default: prompts.json's)"
    )
    ap.add_argument(
        "--max-tokens-256", type=int, default=32, help="tokens per request at concurrency >= 256 (CPU time)"
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="runs of the whole matrix, modes alternated (docstring)"
    )
    ap.add_argument("--out", default=str(RESULTS / "vllm_spec_decode.json"))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="vllm_spec_decode_"))  # engine logs (paths in the JSON rows)
    _, default_tokens = _prompts()
    base_tokens = args.max_tokens or default_tokens
    max_tokens_for = {c: (args.max_tokens_256 if c >= 256 else base_tokens) for c in args.concurrency}
    rows: list[dict[str, Any]] = []
    t0 = time.time()

    def save() -> dict[str, dict[str, Any]]:  # after every engine run: a partial matrix survives
        summary = summarize(rows, args.modes, args.ks, args.concurrency, args.impls)
        payload = {
            "benchmark": "vllm_spec_decode",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "args": vars(args),
            "total_s": time.time() - t0,
            "rows": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
            **summary,
        }
        out.write_text(json.dumps(payload, indent=1))
        return summary

    for rnd in range(args.rounds):
        modes = args.modes if rnd % 2 == 0 else args.modes[::-1]
        for mode in modes:
            for k in args.ks:
                for impl in args.impls:
                    new = run_one(
                        impl, k, args.dtype, mode == "eager", workdir, args.concurrency, max_tokens_for
                    )
                    rows.extend(new)
                    for row in new:
                        row["round"] = rnd
                        tag = f"{impl:5s} {mode:8s} k={k} c={row['concurrency']:3d}"
                        if args.rounds > 1:
                            tag = f"round {rnd} {tag}"
                        if "error" in row:
                            print(f"{tag}: ERROR {row['error']} (log {row['log']})", flush=True)
                            continue
                        rate = row["acceptance_rate"]
                        print(
                            f"{tag}: {row['output_tokens_per_s']:7.1f} tok/s  acceptance "
                            f"{rate if rate is not None else float('nan'):.3f}  startup {row['startup_s']:.0f} s",
                            flush=True,
                        )
                    save()
    summary = save()
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
