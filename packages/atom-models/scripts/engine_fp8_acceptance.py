"""The standalone engine on the tiny FP8 checkpoint (FP8 weights, bf16 or FP8 KV cache) beside the bf16
checkpoint, greedy on the fixture's prompts.json (16 prompts, max_tokens 128), MTP k = 0 and 1.

The FP8 checkpoint is made from the bundled bf16 model by ``make_fp8_checkpoint.py`` (into a temporary
directory unless ``--fp8-model DIR`` names one). For every run: vLLM-style spec-decode counters, prompts
whose output equals the bf16 checkpoint's at the same k, and (teacher-forcing the emitted tokens through
the float32 model of the **bf16** checkpoint, the oracle) how many emitted tokens are not the float32
argmax and the largest logit gap. Writes ``benchmarks/results/engine_fp8_acceptance.json``.

    .venv/bin/python packages/atom-models/scripts/engine_fp8_acceptance.py [--dtype bfloat16] [--ks 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import torch
from atom_core import Qwen3NextConfig
from atom_core.paths import default_model_dir, reference_dir
from atom_kernels import select_kernels
from atom_models import DenseCoreFactory, Qwen3NextForCausalLM, load_target
from atom_models.engine import EngineConfig, LLMEngine, SamplingParams, SpecStats

HERE = Path(__file__).resolve().parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp8-model", type=Path, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--ks", nargs="+", type=int, default=[1])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_fp8_acceptance.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    off_argmax = _load("engine_acceptance").off_argmax
    bf16_dir = default_model_dir()
    tmp = tempfile.TemporaryDirectory()
    fp8_dir = args.fp8_model or Path(tmp.name) / "tiny-fp8"
    if args.fp8_model is None:
        _load("make_fp8_checkpoint").make_fp8_checkpoint(bf16_dir, fp8_dir)
    spec = json.loads((reference_dir() / "prompts.json").read_text())
    prompts = [p["prompt_token_ids"] for p in spec["prompts"]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    k32 = select_kernels("cpu", torch.float32)
    ref = Qwen3NextForCausalLM(Qwen3NextConfig.from_hf(bf16_dir), DenseCoreFactory(k32), k32)
    load_target(ref, bf16_dir)

    runs, bf16_outputs = [], {}
    setups = [("bf16 checkpoint", bf16_dir, "auto"), ("fp8 checkpoint", fp8_dir, "auto"),
              ("fp8 checkpoint", fp8_dir, "fp8")]  # fmt: skip
    for label, model_dir, kv in setups:
        for k in [0, *args.ks]:
            ec = EngineConfig(
                num_speculative_tokens=k, max_num_seqs=len(prompts), max_model_len=512, kv_cache_dtype=kv
            )
            eng = LLMEngine.from_pretrained(model_dir, ec, dtype=DTYPES[args.dtype])
            t0 = time.perf_counter()
            results = eng.generate(prompts, params)
            elapsed = time.perf_counter() - t0
            outs = [r.output_ids for r in results]
            stats = SpecStats()
            for r in results:
                stats.merge(r.stats)
            if label.startswith("bf16"):
                bf16_outputs[k] = outs
            run = {
                "checkpoint": label,
                "kv_cache_dtype": kv,
                "dtype": args.dtype,
                "k": k,
                **stats.as_dict(),
                "wall_s": round(elapsed, 2),
                "prompts_identical_to_bf16_checkpoint": sum(a == b for a, b in zip(outs, bf16_outputs[k])),
                **off_argmax(ref, prompts, outs),
            }
            runs.append(run)
            print(
                f"{label} kv={kv:4s} k={k}: drafts {run['num_drafts']:5d} accepted {run['num_accepted_tokens']:5d} "
                f"rate {100 * run['acceptance_rate']:5.1f}% mean len {run['mean_acceptance_length']:.2f} | "
                f"same as bf16 ckpt: {run['prompts_identical_to_bf16_checkpoint']}/16 | off-argmax "
                f"{run['off_argmax_tokens']}/{run['tokens']} (max gap {run['largest_gap']:.3f}) | {elapsed:.1f}s",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"prompts": str(reference_dir() / "prompts.json"), "max_tokens": args.max_tokens, "runs": runs}
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
