"""The product on the GPU: vLLM 0.32 serving the plugin's Qwen3-Next at 80B-A3B-FP8 width (random weights),
the seed's flags, batches of concurrent requests; tokens/s and the time of one engine step.

What runs: ``vllm.LLM`` (vLLM's Python package of the CPU wheel, ``scripts/gpu_vllm_bundle.sh``'s bundle,
with ``scripts/gpu_vllm_run.py``'s stand-ins written before) on a checkpoint directory holding only
``config.json`` (``bench_plugin_graphs.write_config``: 80B-A3B width, ``--layers`` layers 3:1 GDN:attention,
one MTP layer, the FP8 checkpoint's ``quantization_config``), ``load_format="dummy"`` and then
``bench_engine.randomize_parameters`` in every worker (``collective_rpc``: std-0.02 weights, random e4m3
with block scales, so the router spreads tokens over the experts as a trained model does);
``kv_cache_dtype="fp8"``, ``cudagraph_mode`` ``--cudagraph-mode`` (the seed's ``FULL_AND_PIECEWISE``;
``PIECEWISE`` is what builders declaring NEVER got), MTP ``--k`` (0: no speculative decoding), prefix
caching off, token-id prompts (no tokenizer).

Per concurrency c in ``--concurrency``: c random prompts of ``--input-len`` tokens are submitted at once,
greedy, ``ignore_eos``; once untimed (new batch shapes compile kernels), then once with 16 output tokens and
once with ``16 + --output-len``; the difference
is the decode time of ``--output-len`` tokens per request (prefill and the first steps cancel). Reported:
output tokens/s of the whole batch in decode, the engine steps that took (from the spec-decode counters:
tokens per step = 1 + accepted drafts per step) and so the step time, and the projected single-stream
tokens/s at the seed's acceptance length 1.91 (random weights accept almost no drafts; the step time is
what the product costs, the acceptance is the model's). JSON ``vllm_80b_<mode>_k<k>_<gpu>.json``.

    python benchmarks/gpu/bench_vllm_80b.py --layers 32 --k 1 --out $OUT   # an H100; 48 layers need an H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "scripts"))  # llm_spec_counters
SEED_ACCEPTANCE_LENGTH = 1.91


def _randomize_worker(worker: Any) -> dict[str, Any]:
    """Runs in each worker (collective_rpc): random weights for the target and the MTP draft."""
    import sys

    import torch

    sys.path.insert(0, str(HERE))
    import bench_engine

    runner = worker.model_runner
    mods = []
    for m in (runner.model, getattr(getattr(runner, "drafter", None), "model", None)):
        if m is None:
            continue
        m = m.unwrap() if hasattr(m, "unwrap") else m
        mods.append(m)
    g = torch.Generator(device=torch.device("cuda", torch.cuda.current_device())).manual_seed(0)
    with torch.no_grad():
        bench_engine.randomize_parameters(mods, g)
    torch.cuda.synchronize()
    return {
        "randomized": [type(m).__name__ for m in mods],
        "params_gb": sum(p.numel() * p.element_size() for m in mods for p in m.parameters()) / 1e9,
        "model_runner": type(runner).__name__,
        "cudagraph_mode": str(worker.vllm_config.compilation_config.cudagraph_mode),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.93)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    import bench_engine
    import common
    import torch
    from bench_plugin_graphs import write_config
    from llm_spec_counters import spec_counters
    from vllm import LLM, SamplingParams

    out = common.out_dir(str(args.out) if args.out else None)
    ckpt = write_config(bench_engine.WIDE, args.layers, True, Path(tempfile.mkdtemp(prefix="atom80b_")))
    max_c = max(args.concurrency)
    sizes = sorted({s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if s <= max_c * (1 + args.k)})
    kwargs = dict(
        model=str(ckpt), skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", kv_cache_dtype="fp8",
        max_model_len=args.input_len + args.output_len + 64, max_num_seqs=max_c,
        max_num_batched_tokens=8192, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False, disable_log_stats=False, seed=0,
        speculative_config={"method": "mtp", "num_speculative_tokens": args.k} if args.k else None,
        compilation_config={"cudagraph_mode": args.cudagraph_mode, "cudagraph_capture_sizes": sizes,
                            # vLLM's quant-fusion passes pattern-match vLLM's own CUDA norm / activation /
                            # quant ops: the plugin's model has none of them, and on this machine they are
                            # gpu_vllm_run's placeholders, which the passes cannot trace
                            "pass_config": {"fuse_norm_quant": False, "fuse_act_quant": False,
                                            "fuse_attn_quant": False}},
    )  # fmt: skip
    result: dict[str, Any] = {"env": common.environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result["startup_s"] = round(time.perf_counter() - t0, 1)
    result["workers"] = llm.collective_rpc(_randomize_worker)
    print(json.dumps({"startup_s": result["startup_s"], "workers": result["workers"]}), flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    warm = [{"prompt_token_ids": torch.randint(10, 150000, (args.input_len,), generator=g).tolist()}]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for c in args.concurrency:
        prompts = [
            {"prompt_token_ids": torch.randint(10, 150000, (args.input_len,), generator=g).tolist()}
            for _ in range(c)
        ]
        # first run at this concurrency: new batch shapes JIT-compile kernels and warm caches; not timed
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        times, counters = [], []
        for n in (16, 16 + args.output_len):
            before = spec_counters(llm)
            t = time.perf_counter()
            outs = llm.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False
            )
            times.append(time.perf_counter() - t)
            after = spec_counters(llm)
            counters.append({key: after[key] - before[key] for key in after})
            assert all(len(o.outputs[0].token_ids) == n for o in outs), "a request stopped early"
        decode_s = times[1] - times[0]
        drafts = counters[1]["num_drafts"] - counters[0]["num_drafts"]
        accepted = counters[1]["num_accepted_tokens"] - counters[0]["num_accepted_tokens"]
        tokens_per_step = 1 + (accepted / drafts if drafts else 0.0)
        steps = args.output_len / tokens_per_step
        step_ms = decode_s / steps * 1e3
        row = {"concurrency": c, "decode_s": decode_s, "total_s_short": times[0], "total_s_long": times[1],
               "decode_tokens_per_s": c * args.output_len / decode_s, "tokens_per_step": tokens_per_step,
               "step_ms": step_ms,
               "projected_stream_tokens_per_s": SEED_ACCEPTANCE_LENGTH / step_ms * 1e3 if args.k else 1e3 / step_ms,
               "counters": counters}  # fmt: skip
        if decode_s <= 0:  # the two runs' prefill times differ by more than the decode takes
            row["invalid"] = "long run not slower than short run: prefill variance exceeds the decode time"
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "counters"}), flush=True)
    result["rows"] = rows
    name = f"vllm_80b_{args.cudagraph_mode.lower()}_k{args.k}_{common.gpu_tag(torch.device('cuda'))}"
    if args.layers != bench_engine.FP8_LAYERS:
        name += f"_{args.layers}layers"
    common.write_json(out / f"{name}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
