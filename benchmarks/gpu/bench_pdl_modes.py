"""The FP8 engine's graphed step under each launch / metadata mode, side by side in one process.

One engine (80B-A3B width, FP8, ``--layers`` layers + MTP, fp8 KV cache, random weights, k = ``--k``) is built
once. For every batch size and round, each mode sets its environment, drops the engine's CUDA graphs (they
are captured again under the mode's launch options), places ``B`` fresh requests at ``--ctx`` tokens and
times ``--steps`` graphed engine steps (median wall time, host included; ``bench_engine.host_breakdown``'s
phases) and the target and propose graphs alone (replays). Rounds alternate the order of the modes. Modes:

- ``off``: ``ATOM_KERNELS_PDL=0`` (plain launches);
- ``pdl``: programmatic dependent launch (the default);
- ``host_fill``: as ``pdl``, but every step's metadata is filled on the host and copied, as if the
  previous step had not advanced it on the device (``DecodeGraphs._continues`` answers no).

Launch forms measured slower in the engine and removed (trigger before the wait, L2 prefetch of static
weights before it): ``benchmarks/results/pdl_launch_modes_h100_32layers.json``. ``--out``:
``pdl_modes_<gpu>_<layers>layers.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine  # noqa: E402
import common  # noqa: E402

MODES = {
    "off": {"ATOM_KERNELS_PDL": "0"},
    "pdl": {"ATOM_KERNELS_PDL": "1"},
    "host_fill": {"ATOM_KERNELS_PDL": "1"},
}


def drop_graphs(engine) -> None:
    g = engine.graphs
    g._targets.clear()
    g._proposers.clear()
    gc.collect()


def main() -> None:
    from atom_models.engine import EngineConfig, LLMEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    args = ap.parse_args()
    out = common.out_dir(args.out)
    if args.smoke:
        device, dtype, ceil = torch.device("cpu"), torch.float32, {}
        dims = {**bench_engine.SMOKE, "num_hidden_layers": 2}
        args.ctx, args.steps, args.batches = 32, 2, [1, 2]
    else:
        device, dtype = common.require_cuda(), torch.bfloat16
        ceil = common.ceilings(out, device)
        dims = {**bench_engine.WIDE, "num_hidden_layers": args.layers}
    cfg = bench_engine.model_config(dims, True)
    max_tokens = 4 * (args.steps + 4) * (1 + args.k) + 32
    ec = EngineConfig(
        num_speculative_tokens=args.k,
        max_num_seqs=max(args.batches),
        max_model_len=args.ctx + max_tokens,
        cuda_graphs=True,
        kv_cache_dtype="fp8",
    )
    t0 = time.perf_counter()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: list[dict] = []
    with torch.no_grad():
        engine = LLMEngine(cfg, ec, dtype=dtype, device=device)
        bench_engine.randomize(engine, seed=args.k)
        print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
        for b in args.batches:
            for rnd in range(args.rounds):
                order = args.modes if rnd % 2 == 0 else args.modes[::-1]
                for mode in order:
                    os.environ.update(MODES[mode])
                    g = engine.graphs
                    if mode == "host_fill":  # every step filled on the host: no device-advanced metadata
                        g._continues = lambda *a: False
                    else:
                        g.__dict__.pop("_continues", None)
                    drop_graphs(engine)
                    bench_engine.place_running(engine, b, args.ctx, max_tokens, seed=b)
                    bench_engine.time_steps(engine, 3, sync)  # capture this bucket under the mode
                    step = bench_engine.time_steps(engine, args.steps, sync)
                    host = bench_engine.host_breakdown(engine, args.steps, sync)
                    bucket = g.bucket(b)
                    target = bench_engine.gpu_ms(g._targets[(1 + args.k, bucket)], args.smoke)
                    prop = g._proposers.get((args.k, bucket))
                    propose = bench_engine.gpu_ms(prop, args.smoke) if prop is not None else None
                    bench_engine.clear_running(engine)
                    r = {"bench": "engine_pdl_mode", "mode": mode, "B": b, "k": args.k, "round": rnd,
                         "step_ms": step, "target_ms": target, "propose_ms": propose, "host_ms": host,
                         "advanced_steps": g.advanced_steps}  # fmt: skip
                    rows.append(r)
                    print(r, flush=True)
    summary = []
    for b in args.batches:
        for mode in args.modes:
            rs = [r for r in rows if r["B"] == b and r["mode"] == mode]
            summary.append(
                {
                    "B": b,
                    "mode": mode,
                    "step_ms": statistics.median(r["step_ms"] for r in rs),
                    "target_ms": statistics.median(r["target_ms"] for r in rs),
                    "propose_ms": statistics.median(r["propose_ms"] or 0.0 for r in rs),
                }
            )
    common.print_table(summary, ["B", "mode", "step_ms", "target_ms", "propose_ms"])
    name = f"pdl_modes_{common.gpu_tag(device)}_{cfg.num_hidden_layers}layers.json"
    payload = {
        "env": common.environment() if not args.smoke else {},
        "ceilings": ceil,
        "layers": cfg.num_hidden_layers,
        "k": args.k,
        "rows": rows,
        "summary": summary,
        "wall_s": time.perf_counter() - t0,
    }
    common.write_json(out / name, payload)


if __name__ == "__main__":
    main()
