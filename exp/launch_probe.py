"""Experiment (H200): host time of the FP8 engine's graph replays (k = 1), GPU idle vs busy, B = 1 / 8."""
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, "benchmarks/gpu")
import bench_engine as be  # noqa: E402
from atom_models.engine import EngineConfig, LLMEngine  # noqa: E402

dev = torch.device("cuda")
cfg = be.model_config({**be.WIDE, "num_hidden_layers": be.FP8_LAYERS}, True)
k = 1
with torch.no_grad():
    engine = LLMEngine(cfg, EngineConfig(num_speculative_tokens=k, max_num_seqs=8, max_model_len=1200,
                                         cuda_graphs=True, kv_cache_dtype="fp8"), dtype=torch.bfloat16, device=dev)
    be.randomize(engine, seed=1)
    for b in (1, 8, 1):
        be.place_running(engine, b, 1024, 60, seed=b)
        be.time_steps(engine, 3, torch.cuda.synchronize)
        g = engine.graphs
        bucket = g.bucket(b)
        for name, entry in (("target", g._targets[(1 + k, bucket)]), ("propose", g._proposers.get((k, bucket)))):
            idle, busy = [], []
            for _ in range(8):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                entry.graph.replay()
                idle.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                entry.graph.replay()  # queued behind the first
                busy.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
            print(f"B={b} bucket={bucket} {name}: replay host ms idle {statistics.median(idle):.3f} "
                  f"behind another {statistics.median(busy):.3f}", flush=True)
        host = be.host_breakdown(engine, 5, torch.cuda.synchronize)
        print(f"B={b} host phases", {n: round(v, 3) for n, v in host.items()}, flush=True)
        be.clear_running(engine)
