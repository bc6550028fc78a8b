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
greedy, ``ignore_eos``; once untimed (new batch shapes compile kernels), then once with ``--output-len``
tokens. Each request's decode time per output token (TPOT) comes from vLLM's request stats (first to last
token on the engine core's clock), so each request's own prefill and queueing do not enter; the median TPOT
still holds the steps that ran other requests' prompt chunks beside it (what a user of that batch sees).
The request whose first token came last decodes only after every prompt was prefilled: its TPOT x tokens
per step (1 + accepted drafts per step, from the spec-decode counters) is the decode step of the full batch
(``decode_step_ms``; the batch shrinks only as its earlier peers finish). Reported: both, the batch's
decode tokens/s at that step, and the projected single-stream tokens/s at the seed's
acceptance length 1.91 (random weights accept almost no drafts; the step time is what the product costs,
the acceptance is the model's). ``--profile-tokens N`` then profiles one stream of N tokens with vLLM's own
worker profiler (``trace_steps.py`` reads the trace: GPU busy and idle per step, and what the host was doing
while the GPU waited); ``--host-profile-tokens N`` cProfiles the engine-core thread (scheduler and worker
steps) over one stream of N tokens into ``<name>_host_profile.txt``. JSON ``vllm_80b_<mode>_k<k>_<gpu>.json``.

    python benchmarks/gpu/bench_vllm_80b.py --layers 32 --k 1 --profile-tokens 48 --out $OUT  # H100: 32 layers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    # The MTP draft: V1's runner holds it as ``drafter.model``, Model Runner V2's as ``speculator.model``.
    draft_owner = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    mods = []
    for m in (runner.model, getattr(draft_owner, "model", None)):
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
        "model_runner": f"{type(runner).__module__}.{type(runner).__name__}",
        "cudagraph_mode": str(worker.vllm_config.compilation_config.cudagraph_mode),
    }


def _cprofile_start(worker: Any) -> bool:
    """Runs in the engine-core process (collective_rpc): Python's deterministic profiler on the thread that
    runs the scheduler and the worker's steps."""
    import cProfile

    worker.atom_cprofile = cProfile.Profile()
    worker.atom_cprofile.enable()
    return True


def _cprofile_stop(worker: Any, rows: int = 60) -> str:
    """Stops :func:`_cprofile_start`'s profiler; its functions by own time and by cumulative time, as text."""
    import io
    import pstats

    prof = worker.atom_cprofile
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return text.getvalue()


def host_profile_one_stream(llm: Any, args: argparse.Namespace, g: Any) -> dict[str, Any]:
    """cProfile of the engine-core thread over one stream decoding ``--host-profile-tokens`` tokens: where
    the host's time per step goes (function level; the profiler slows Python about 2x, so compare shares).
    The text goes to ``<name>_host_profile.txt`` beside the JSON."""
    import torch
    from vllm import SamplingParams

    prompt = [{"prompt_token_ids": torch.randint(10, 150000, (args.input_len,), generator=g).tolist()}]
    n = args.host_profile_tokens
    llm.collective_rpc(_cprofile_start)
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    text = llm.collective_rpc(_cprofile_stop)[0]
    return {"tokens": n, "wall_s": wall, "text": text}


def measure(llm: Any, prompts: list[dict[str, Any]], n: int, k: int) -> dict[str, Any]:
    """One timed ``generate`` of ``n`` greedy tokens per prompt, all submitted at once. The decode time per
    token (TPOT) is each request's own, from vLLM's request stats (first to last token, engine-core clock),
    so prefill and the queue before it do not enter; the step time is TPOT x tokens per step."""
    from llm_spec_counters import spec_counters
    from vllm import SamplingParams

    before = spec_counters(llm)
    t = time.perf_counter()
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False
    )
    wall = time.perf_counter() - t
    after = spec_counters(llm)
    counters = {key: after[key] - before[key] for key in after}
    if any(len(o.outputs[0].token_ids) != n for o in outs):
        raise RuntimeError(f"a request stopped before its {n} tokens")
    if any(o.metrics is None for o in outs):
        raise RuntimeError("vLLM returned no request stats (LLM needs disable_log_stats=False)")
    tpot = sorted((o.metrics.last_token_ts - o.metrics.first_token_ts) / (n - 1) for o in outs)
    # the request whose first token came last decodes only after every prompt of the batch was prefilled:
    # its TPOT is the decode step of the full batch (the batch shrinks only as its earlier peers finish)
    last = max(outs, key=lambda o: o.metrics.first_token_ts).metrics
    tpot_last_ms = (last.last_token_ts - last.first_token_ts) / (n - 1) * 1e3
    ttft = sorted(o.metrics.first_token_ts - o.metrics.scheduled_ts for o in outs)
    tpot_ms = statistics.median(tpot) * 1e3
    tokens_per_step = 1 + (
        counters["num_accepted_tokens"] / counters["num_drafts"] if counters["num_drafts"] else 0.0
    )
    step_ms = tpot_ms * tokens_per_step
    decode_step_ms = tpot_last_ms * tokens_per_step
    return {"concurrency": len(prompts), "output_len": n, "wall_s": wall, "tpot_ms_median": tpot_ms,
            "tpot_ms_min_max": [tpot[0] * 1e3, tpot[-1] * 1e3], "ttft_s_median": statistics.median(ttft),
            "decode_tokens_per_s": len(prompts) / (tpot_ms / 1e3), "tokens_per_step": tokens_per_step,
            "step_ms": step_ms, "tpot_ms_last_started": tpot_last_ms, "decode_step_ms": decode_step_ms,
            "decode_step_tokens_per_s": len(prompts) * tokens_per_step / decode_step_ms * 1e3,
            "projected_stream_tokens_per_s": (SEED_ACCEPTANCE_LENGTH if k else 1.0) / decode_step_ms * 1e3,
            "counters": counters}  # fmt: skip


def profile_one_stream(llm: Any, args: argparse.Namespace, g: Any) -> dict[str, Any]:
    """vLLM's own worker profiler (torch, CPU + CUDA) over one stream decoding ``--profile-tokens`` tokens;
    the trace is read by :mod:`trace_steps` (GPU busy vs idle per step, idle time by host phase)."""
    import torch
    import trace_steps
    from vllm import SamplingParams

    prompt = [{"prompt_token_ids": torch.randint(10, 150000, (args.input_len,), generator=g).tolist()}]
    llm.start_profile()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=args.profile_tokens, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    llm.stop_profile()
    traces = sorted(Path(args.profile_dir).rglob("*.json*"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise RuntimeError(f"vLLM's profiler wrote no trace under {args.profile_dir}")
    report = trace_steps.analyse(trace_steps.load_events(traces[-1]), skip=3)
    report.pop("per_step")
    report["trace"] = traces[-1].name
    print(json.dumps(report, indent=1), flush=True)
    return report


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
    ap.add_argument(
        "--profile-tokens", type=int, default=0, help="also profile one stream of this many tokens"
    )
    ap.add_argument("--profile-stack", action="store_true", help="record Python stacks in the profile")
    ap.add_argument(
        "--host-profile-tokens", type=int, default=0,
        help="also cProfile the engine-core thread over one stream of this many tokens",
    )  # fmt: skip
    args = ap.parse_args()
    args.profile_dir = str((args.out or Path(tempfile.gettempdir())) / "vllm_profile")
    if args.profile_tokens:
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    import bench_engine
    import common
    import torch
    from bench_plugin_graphs import write_config
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
        profiler_config={"profiler": "torch", "torch_profiler_dir": args.profile_dir, "torch_profiler_with_stack": args.profile_stack}
        if args.profile_tokens else None,
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
    t0 = time.perf_counter()
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    # the server's first prompt: any kernel compiled or autotuned on first use shows up here
    result["first_request_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps({"first_request_s": result["first_request_s"]}), flush=True)
    for c in args.concurrency:
        prompts = [
            {"prompt_token_ids": torch.randint(10, 150000, (args.input_len,), generator=g).tolist()}
            for _ in range(c)
        ]
        # first run at this concurrency: new batch shapes JIT-compile kernels and warm caches; not timed
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        rows.append(measure(llm, prompts, args.output_len, args.k))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "counters"}), flush=True)
    if args.profile_tokens:
        result["profile"] = profile_one_stream(llm, args, g)
    result["rows"] = rows
    name = f"vllm_80b_{args.cudagraph_mode.lower()}_k{args.k}_{common.gpu_tag(torch.device('cuda'))}"
    if args.layers != bench_engine.FP8_LAYERS:
        name += f"_{args.layers}layers"
    if args.host_profile_tokens:
        host = host_profile_one_stream(llm, args, g)
        (out / f"{name}_host_profile.txt").write_text(host.pop("text"))
        result["host_profile"] = host
        print(json.dumps(host), flush=True)
    common.write_json(out / f"{name}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
