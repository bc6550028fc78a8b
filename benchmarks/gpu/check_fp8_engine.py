"""The standalone engine on a GPU with the tiny FP8 checkpoint (FP8 weights through the triton FP8 GEMM and
MoE, optional e4m3 KV cache) beside the bf16 checkpoint, greedy, MTP k = 0 and 1.

Makes the FP8 checkpoint from ``data/tiny-qwen3-next-mtp`` with
``packages/atom-models/scripts/make_fp8_checkpoint.py`` (in a temporary directory), then for each
(checkpoint, KV dtype, k) in bf16: spec-decode counters, wall time, prompts (and tokens) equal to the bf16
checkpoint's outputs at the same k. With ``--greedy greedy.json`` also float32 on the FP8 checkpoint with an
fp8 KV cache: k = 1 must emit the k = 0 tokens (lossless), and the share of tokens equal to the bf16 model's
float32 greedy continuations. Needs ``packages/atom-models/src`` on PYTHONPATH (and safetensors).

Usage: python benchmarks/gpu/check_fp8_engine.py --prompts prompts.json [--greedy greedy.json] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--greedy", type=Path, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (reference kernels)")
    args = ap.parse_args()
    out = common.out_dir(args.out)
    from atom_models.engine import EngineConfig, LLMEngine, SamplingParams, SpecStats

    spec = importlib.util.spec_from_file_location(
        "make_fp8_checkpoint", ROOT / "packages/atom-models/scripts/make_fp8_checkpoint.py"
    )
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    bf16_dir = ROOT / "data" / "tiny-qwen3-next-mtp"
    tmp = tempfile.TemporaryDirectory()
    fp8_dir = Path(tmp.name) / "tiny-fp8"
    mk.make_fp8_checkpoint(bf16_dir, fp8_dir)
    prompts = [p["prompt_token_ids"] for p in json.loads(args.prompts.read_text())["prompts"]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs, ref = [], {}

    def generate(ckpt, kv, k, dtype, prompt_ids, p):
        ec = EngineConfig(
            num_speculative_tokens=k, max_num_seqs=len(prompt_ids), max_model_len=512, kv_cache_dtype=kv
        )
        eng = LLMEngine.from_pretrained(ckpt, ec, dtype=dtype, device=args.device)
        eng.generate(
            prompt_ids[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )  # warm-up
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        res = eng.generate(prompt_ids, p)
        sync()
        stats = SpecStats()
        for r in res:
            stats.merge(r.stats)
        backends = {
            op: eng.kernels.backend_of(op) for op in ("fp8_linear", "moe_experts_fp8", "paged_attention")
        }
        return [r.output_ids for r in res], stats, time.perf_counter() - t0, backends

    for label, ckpt, kv in (("bf16", bf16_dir, "auto"), ("fp8", fp8_dir, "auto"), ("fp8", fp8_dir, "fp8")):
        for k in (0, 1):
            outs, stats, wall, backends = generate(ckpt, kv, k, torch.bfloat16, prompts, params)
            if label == "bf16":
                ref[k] = outs
            same_tok = sum(a == b for o, r in zip(outs, ref[k]) for a, b in zip(o, r))
            run = dict(checkpoint=label, kv_cache_dtype=kv, dtype="bfloat16", k=k, **stats.as_dict(),
                       wall_s=round(wall, 3), prompts_identical_to_bf16=sum(o == r for o, r in zip(outs, ref[k])),
                       tokens_equal_to_bf16=same_tok, tokens=sum(len(o) for o in outs), backends=backends)  # fmt: skip
            runs.append(run)
            print(json.dumps(run), flush=True)
    if args.greedy is not None:
        cases = json.loads(args.greedy.read_text())["cases"]
        p32 = SamplingParams(max_tokens=len(cases[0]["greedy_ids"]), temperature=0.0, ignore_eos=True)
        ids = [c["prompt_ids"] for c in cases]
        o0, _, _, _ = generate(fp8_dir, "fp8", 0, torch.float32, ids, p32)
        o1, s1, _, backends = generate(fp8_dir, "fp8", 1, torch.float32, ids, p32)
        eq = sum(a == b for o, c in zip(o0, cases) for a, b in zip(o, c["greedy_ids"]))
        run = dict(checkpoint="fp8", kv_cache_dtype="fp8", dtype="float32", check="greedy.json",
                   k1_equals_k0=o1 == o0, acceptance_rate_k1=s1.as_dict()["acceptance_rate"],
                   tokens_equal_to_float32_greedy=eq, tokens=sum(len(o) for o in o0), backends=backends)  # fmt: skip
        runs.append(run)
        print(json.dumps(run), flush=True)
    common.write_json(out / "fp8_engine_h200.json", {"env": common.environment(), "runs": runs})


if __name__ == "__main__":
    main()
