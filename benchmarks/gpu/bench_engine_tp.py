"""The standalone engine at tensor parallelism N against TP = 1, in one call: decode / verify step time,
per-GPU memory and all-reduce time per step.

Model: bench_engine.py's (80B-A3B width, ``--layers`` target layers, 3:1 GDN:attention, + one MTP layer,
random weights; bf16, or ``--fp8`` FP8 weights built directly in FP8). One spawned process per rank
(``atom_models.engine.tp_launch.launch``: NCCL with ``cuda:<rank>``, or gloo on the CPU with ``--smoke``);
every rank builds its shards (``LLMEngine(parallel=...)``), randomises them from the same seed (replicated
weights equal on every rank) and steps the same ``B`` running requests at context ``--ctx``. Then the same
with TP = 1 (one spawned process). Per (TP, k, B):

- ``step_ms_eager`` / ``step_ms_graphed``: median wall time of ``LLMEngine.step`` (synchronised), CUDA
  graphs off / on (the graphed forward holds the NCCL all-reduces), the slowest rank's;
- ``allreduce_ms`` / ``allgather_ms`` / ``broadcast_ms``: time in those collectives during one profiled
  eager step (torch.profiler: NCCL kernels' GPU time, or gloo ops' CPU time), with their counts;
- ``floor_ms``: the rank's bytes (bench_engine.floor_bytes over its shards) over the copy bandwidth;
- ``mem_gb``: per rank, ``torch.cuda.max_memory_allocated`` while the case ran (weights + caches + work);
  ``weights_gb`` per rank.

JSON ``engine_tp{N}.json`` and PNG ``engine_tp{N}.png`` (graphed step time, TP=N vs TP=1) to ``--out``.

    python benchmarks/gpu/bench_engine_tp.py --tp 2                 # N GPUs (H200 x N), bf16, 8 layers
    python benchmarks/gpu/bench_engine_tp.py --tp 2 --fp8 --layers 48
    python benchmarks/gpu/bench_engine_tp.py --tp 2 --smoke         # CPU, gloo, tiny dims (checks the script)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine as be  # noqa: E402
import common  # noqa: E402

COLLECTIVES = {
    "allreduce": ("allreduce", "all_reduce"),
    "allgather": ("allgather", "all_gather"),
    "broadcast": ("broadcast",),
}


def _collective(name: str) -> str | None:
    n = name.lower().replace("::", "_")
    for what, keys in COLLECTIVES.items():
        if any(k in n for k in keys):
            return what
    return None


def profile_collectives(engine, device) -> dict:
    """Milliseconds and counts of the collectives in one eager step (after one unprofiled eager step)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    graphs, engine.runner.graphs = engine.graphs, None
    try:
        engine.step()
        with profile(activities=acts) as prof:
            engine.step()
            if cuda:
                torch.cuda.synchronize(device)
    finally:
        engine.runner.graphs = graphs
    out = {f"{w}_{x}": 0.0 if x == "ms" else 0 for w in COLLECTIVES for x in ("ms", "count")}
    for e in prof.key_averages():
        what = _collective(e.key)
        if what is None:
            continue
        if cuda:  # the NCCL kernels (ncclDevKernel_AllReduce_..., ncclKernel_AllGather_...)
            if e.device_type != torch.autograd.DeviceType.CUDA or "nccl" not in e.key.lower():
                continue
            ms = e.self_device_time_total / 1e3
        else:  # gloo: its own events (gloo:all_reduce ...: the algorithm and the wait for the peers; the
            # c10d:: events only enqueue)
            if not e.key.startswith("gloo:"):
                continue
            ms = e.cpu_time_total / 1e3
        out[f"{what}_ms"] += ms
        out[f"{what}_count"] += e.count
    return out


def rank_bench(parallel, device, opts: dict) -> list[dict]:
    """One rank: every (k, B) case; its rows (this rank's timings and memory)."""
    from atom_models.engine import EngineConfig, LLMEngine

    torch.set_num_threads(opts["threads"])
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    cfg = be.model_config(opts["dims"], opts["fp8"])
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    with torch.no_grad():
        for k in opts["ks"]:
            max_tokens = 4 * opts["steps"] * (1 + k) + 32
            ec = EngineConfig(
                num_speculative_tokens=k,
                max_num_seqs=max(opts["batches"]),
                max_model_len=opts["ctx"] + max_tokens,
                cuda_graphs=opts["graphs"],
            )
            t0 = time.perf_counter()
            engine = LLMEngine(cfg, ec, dtype=dtype, device=device, parallel=parallel)
            be.randomize(engine, seed=k)
            params = {id(p): p for m in (engine.target, engine.mtp) if m is not None for p in m.parameters()}
            weights_gb = sum(p.numel() * p.element_size() for p in params.values()) / 1e9
            if parallel.rank == 0:
                print(f"TP={parallel.world_size} k={k}: built in {time.perf_counter() - t0:.1f} s, "
                      f"{weights_gb:.2f} GB of weights per rank", flush=True)  # fmt: skip
            for b in opts["batches"]:
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                be.place_running(engine, b, opts["ctx"], max_tokens, seed=b)
                touched = be.count_touched_experts(engine)
                fb = be.floor_bytes(engine, b, opts["ctx"], touched)
                coll = profile_collectives(engine, device)
                graphs, engine.runner.graphs = engine.graphs, None
                eager = be.time_steps(engine, opts["steps"], sync)
                engine.runner.graphs = graphs
                graphed = None
                if graphs is not None:
                    be.time_steps(engine, 2, sync)  # capture this bucket
                    graphed = be.time_steps(engine, opts["steps"], sync)
                rows.append(
                    {
                        "tp": parallel.world_size,
                        "rank": parallel.rank,
                        "k": k,
                        "B": b,
                        "ctx": opts["ctx"],
                        "step_ms_eager": eager,
                        "step_ms_graphed": graphed,
                        "floor_ms": sum(fb.values()) / (opts["copy_gbps"] * 1e9) * 1e3,
                        "weights_gb": weights_gb,
                        "mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
                        **coll,
                    }
                )
                if parallel.rank == 0:
                    print(f"TP={parallel.world_size} k={k} B={b}: eager {eager:.2f} ms, graphed {graphed} ms, "
                          f"all-reduce {coll['allreduce_ms']:.3f} ms x{coll['allreduce_count']}", flush=True)  # fmt: skip
                be.clear_running(engine)
            del engine, graphs
            gc.collect()  # the graphs hold reference cycles to the models
            if cuda:
                torch.cuda.empty_cache()
    return rows


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (k, B): the slowest rank's times and collectives, every rank's memory."""
    out = []
    for cases in zip(*per_rank):
        r = dict(cases[0])
        del r["rank"]
        for key in ("step_ms_eager", "step_ms_graphed", "allreduce_ms", "allgather_ms", "broadcast_ms"):
            vals = [c[key] for c in cases if c[key] is not None]
            r[key] = max(vals) if vals else None
        r["mem_gb_per_rank"] = [c["mem_gb"] for c in cases]
        r["step_ms_eager_per_rank"] = [c["step_ms_eager"] for c in cases]
        r.pop("mem_gb")
        r["case"] = f"TP={r['tp']} k={r['k']} B={r['B']}"
        out.append(r)
    return out


def main() -> None:
    from atom_models.engine.tp_launch import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (GPUs)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per case")
    ap.add_argument("--layers", type=int, default=None, help="target layers (default 8; --fp8: 48)")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights (bench_engine.py --fp8)")
    ap.add_argument("--no-graphs", action="store_true", help="eager steps only")
    ap.add_argument("--no-tp1", action="store_true", help="skip the TP = 1 baseline")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny dims (checks the script)")
    args = ap.parse_args()
    out = common.out_dir(args.out)
    layers = args.layers or (be.FP8_LAYERS if args.fp8 else be.WIDE["num_hidden_layers"])
    if args.smoke:
        device_type, dims = (
            "cpu",
            {**be.SMOKE, "num_hidden_layers": args.layers or be.SMOKE["num_hidden_layers"]},
        )
        ceil = {"copy_gbps": 10.0, "matmul_tflops": 0.1}
        args.batches, args.ctx, args.steps = [b for b in args.batches if b <= 8] or [1, 8], 32, 2
    else:
        device_type, dims = "cuda", {**be.WIDE, "num_hidden_layers": layers}
        if torch.cuda.device_count() < args.tp:
            why = f"--tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible"
            common.write_json(out / f"engine_tp{args.tp}.json", {"skipped": why})
            print(f"bench_engine_tp skipped: {why}")
            return
        ceil = common.ceilings(out, common.require_cuda())
        torch.cuda.empty_cache()
    opts = {
        "dims": dims,
        "fp8": args.fp8,
        "ks": args.ks,
        "batches": args.batches,
        "ctx": args.ctx,
        "steps": args.steps,
        "graphs": not args.no_graphs,  # on the CPU (--smoke) the bucketed path runs eagerly
        "copy_gbps": ceil["copy_gbps"],
        "threads": 1 if args.smoke else 4,
    }
    rows: list[dict] = []
    name = f"engine_tp{args.tp}"
    t0 = time.perf_counter()
    for tp in [args.tp] + ([] if args.no_tp1 or args.tp == 1 else [1]):
        rows += merge(launch(rank_bench, tp, device_type=device_type, args=(opts,), timeout_s=1800))
        common.write_json(
            out / f"{name}.json", {"ceilings": ceil, "opts": opts, "rows": rows, "partial": True}
        )
    base = {(r["k"], r["B"]): r for r in rows if r["tp"] == 1}
    for r in rows:
        b = base.get((r["k"], r["B"]))
        if b is not None and r["tp"] > 1:
            for key in ("step_ms_eager", "step_ms_graphed"):
                if r[key] and b[key]:
                    r[f"speedup_{key.removeprefix('step_ms_')}"] = b[key] / r[key]
    payload = {
        "env": common.environment() if not args.smoke else {},
        "ceilings": ceil,
        "opts": opts,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    common.write_json(out / f"{name}.json", payload)
    common.print_table(
        rows,
        ["case", "step_ms_eager", "step_ms_graphed", "speedup_graphed", "allreduce_ms", "allreduce_count",
         "allgather_ms", "floor_ms", "weights_gb", "mem_gb_per_rank"],
    )  # fmt: skip
    key = "step_ms_graphed" if opts["graphs"] else "step_ms_eager"
    plot = [
        {"case": f"k={r['k']} B={r['B']}", "impl": f"TP={r['tp']}", "ms": r[key]}
        for r in rows
        if r[key] is not None
    ]
    common.plot_rows(
        out / f"{name}.png", plot, value="ms", title=f"engine step ({key.removeprefix('step_ms_')}), TP={args.tp} vs 1",
        xlabel="ms per step",
    )  # fmt: skip
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
