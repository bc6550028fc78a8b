"""The standalone engine's decode / verify step at Qwen3-Next-80B-A3B width, eager and CUDA-graphed, against
the step's bandwidth floor; plus the bundled tiny model's tokens/s.

Model: hidden 2048, GDN 16/32 heads of 128, attention 16/2 heads of 256, 512 experts top-10 (moe_inter 512)
+ a 512 shared expert, vocab 151936, 8 layers (3:1 GDN:attention) + one MTP layer, bf16, random weights.
For each k in (0, 1, 3) and B in (1, 8, 64, 256): B requests are placed in the running state at context
``--ctx`` (random tokens, random caches) and the engine steps them (target decode / verify forward,
acceptance, MTP drafts; graphed greedy steps accept on the device and read their results with one copy).
Reported per (k, B):

- ``step_ms``: wall time of ``LLMEngine.step`` (host work included), eager (``cuda_graphs`` off) and
  graphed; the median of ``--steps`` steps, each synchronised;
- ``target_ms`` / ``propose_ms``: GPU time of the target forward / the greedy acceptance + MTP propose
  forward alone, eager (the bucketed forward run without a graph) and graphed (graph replay),
  ``common.time_ms``;
- ``floor_ms``: the bytes the step must move over this run's copy bandwidth: every non-expert weight the
  forward reads (lm_head once per target forward and once per draft), the experts the routing actually
  touched (counted per layer in an eager step; the shared expert is folded into the stacked experts as
  pseudo-experts that every token uses, so its bytes count once per step), the GDN state (recurrent state read + written, conv
  history, pending tokens) and the KV cache read; ``frac_floor = floor / time``.

Then a torch.profiler table of one graphed step (k=1, B in ``--profile-batches``; CUDA kernel time by
kernel) and the tiny model's tokens/s (bf16, k=1, graphs off and on, 128 tokens per prompt, concurrency
1 and 16). JSON + PNG to ``--out``.
``--smoke``: tiny shapes on the CPU (the bucketed path runs eagerly there), to check the script.

``--fp8``: the FP8 checkpoint's model (``quantization_config`` of Qwen3-Next-80B-A3B-Instruct-FP8: e4m3
weights in 128x128 blocks except ``lm_head``, ``in_proj_ba``, the routers, ``shared_expert_gate`` and
``mtp.fc``) at the full 48 layers (``--layers``), built directly in FP8 by the engine (no bf16 copy):
random e4m3 values made from random bf16 (no NaN codes), random block scales; an fp8 KV cache (the seed's
``--kv-cache-dtype fp8``; ``--kv-cache-dtype auto`` for bf16); k in (0, 1, 3), B in (1, 8, 64, 256), no profile,
no tiny-model run; the floor counts the FP8 bytes (weights and their block scales, the cache's dtype). k = 1
rows also give the single-stream tokens/s projected at the seed's acceptance length (1.91 tokens per step).
Output ``engine_<gpu>_fp8.json`` / ``.png`` (``engine_<gpu>_fp8_<n>layers`` below 48 layers; the 48-layer
model needs an H200, an H100 runs ``--layers 32``). The command (~4 min of GPU time; ``--ks 1 --batches 1
64`` for ~1 min):

    python benchmarks/gpu/bench_engine.py --fp8 --steps 3
    python benchmarks/gpu/bench_engine.py --fp8 --smoke   # the same on the CPU, tiny dims (~1 min)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

WIDE = {
    "hidden_size": 2048,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "vocab_size": 151936,
    "num_hidden_layers": 8,
}
SMOKE = {
    **WIDE,
    "hidden_size": 256,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_attention_heads": 4,
    "head_dim": 128,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "vocab_size": 4096,
    "num_hidden_layers": 4,
}


FP8_LAYERS = 48  # Qwen3-Next-80B-A3B
SEED_ACCEPTANCE_LENGTH = 1.91  # vLLM's mean acceptance length on the seed's run (k=1, gsm8k)
FP8_MAX = 448.0
FP8_VALUE_STD = 64.0  # random e4m3 values ~ N(0, 64) clamped to +-448; scales bring weights to std ~0.02


def fp8_quantization_config(hf: dict) -> dict:
    """The published FP8 checkpoint's ``quantization_config`` for ``hf`` (make_fp8_checkpoint.py's list)."""
    import importlib.util

    path = ROOT / "packages" / "atom-models" / "scripts" / "make_fp8_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_fp8_checkpoint", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(mod.BLOCK),
        "modules_to_not_convert": mod.modules_to_not_convert(hf),
    }


def model_config(dims: dict, fp8: bool = False):
    import json

    from atom_core import Qwen3NextConfig

    hf = json.loads((ROOT / "data" / "tiny-qwen3-next-mtp" / "config.json").read_text())
    hf.update(dims)
    n = dims["num_hidden_layers"]
    hf["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    hf["mtp_num_hidden_layers"] = 1
    if fp8:
        hf["quantization_config"] = fp8_quantization_config(hf)
    return Qwen3NextConfig.from_hf(hf)


def _fill_fp8(p: torch.Tensor, g: torch.Generator, chunk: int = 1 << 27) -> None:
    """Random e4m3 values from random bf16 (clamped to the finite range: no NaN codes), in slices of
    about ``chunk`` elements along dim 0 (the bf16 temporary stays small)."""
    rows = max(1, chunk // max(1, p[0].numel()))
    for i in range(0, p.shape[0], rows):
        part = p[i : i + rows]
        src = torch.randn(part.shape, dtype=torch.bfloat16, device=p.device, generator=g)
        part.copy_(src.mul_(FP8_VALUE_STD).clamp_(-FP8_MAX, FP8_MAX).to(p.dtype))


@torch.no_grad()
def randomize_parameters(mods, g: torch.Generator) -> None:
    """Random weights of ``mods``: std 0.02, norms near 1, A_log / dt_bias of the GDN's usual range, random
    e4m3 FP8 weights with block scales bringing them to std ~0.02."""
    for mod in mods:
        for name, p in mod.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                _fill_fp8(p, g)
            elif name.endswith("_scale_inv"):  # FP8 block scales: weight std ~0.02 * U(0.5, 1.5)
                p.uniform_(0.5, 1.5, generator=g).mul_(0.02 / FP8_VALUE_STD)
            elif p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                continue
            elif name.endswith("A_log"):
                p.uniform_(0.0, 2.0, generator=g)
            elif "norm" in name or name.endswith("dt_bias"):
                p.normal_(0.0, 0.1, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)


def randomize(engine, seed: int = 0) -> None:
    """Random weights (std 0.02, norms near 1, A_log / dt_bias of the GDN's usual range) and caches."""
    g = torch.Generator(device=engine.device).manual_seed(seed)
    randomize_parameters([engine.target] + ([engine.mtp] if engine.mtp is not None else []), g)
    with torch.no_grad():
        for kc, vc in engine.caches.kv.values():
            for c in (kc, vc):
                if c.dtype == torch.float8_e4m3fn:  # no normal_ for e4m3: draw in bf16, round once
                    c.copy_(torch.empty(c.shape, dtype=torch.bfloat16, device=c.device).normal_(generator=g))
                else:
                    c.normal_(0.0, 1.0, generator=g)
        for st in engine.caches.gdn.values():
            st.conv.normal_(0.0, 0.1, generator=g)
            st.ssm.normal_(0.0, 0.01, generator=g)
            if st.pending is not None:
                st.pending.zero_()


def place_running(engine, batch: int, ctx: int, max_tokens: int, seed: int) -> None:
    """``batch`` requests as if prefilled to ``ctx`` tokens and verified once (``num_accepted = 1``), each
    holding ``k`` random drafts."""
    from atom_models.engine.request import Request
    from atom_models.engine.sampling import SamplingParams

    sched, k, vocab = engine.scheduler, engine.engine_config.num_speculative_tokens, engine.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        prompt = torch.randint(0, vocab, (ctx,), generator=g).tolist()
        req = Request(engine._next_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), k)
        engine._next_id += 1
        req.blocks = engine.caches.blocks.allocate(sched.blocks_needed(req))
        req.slot = engine.caches.slots.allocate()
        req.output_ids = [int(torch.randint(0, vocab, (1,), generator=g))]
        req.num_computed, req.num_accepted = ctx, 1
        req.drafts = torch.randint(0, vocab, (k,), generator=g).tolist()
        sched.running.append(req)


def clear_running(engine) -> None:
    for req in list(engine.scheduler.running):
        engine.scheduler.free(req)
    engine.scheduler.running.clear()


def count_touched_experts(engine) -> dict[str, list[int]]:
    """One eager step with hooks on every MoE: distinct experts routed to, per layer, target and MTP (the
    shared expert's pseudo-experts included: every token routes to them)."""
    from atom_models.moe import Experts, Fp8Experts

    touched: dict[str, list[int]] = {"target": [], "mtp": []}
    hooks = []
    for part, mod in (("target", engine.target), ("mtp", engine.mtp)):
        if mod is None:
            continue
        for m in mod.modules():
            if isinstance(m, (Experts, Fp8Experts)):

                def hook(_m, args, part=part):
                    touched[part].append(int(args[3].unique().numel()))

                hooks.append(m.register_forward_pre_hook(hook))
    graphs, engine.runner.graphs = engine.graphs, None
    try:
        engine.step()
    finally:
        engine.runner.graphs = graphs
        for h in hooks:
            h.remove()
    return touched


def floor_bytes(engine, batch: int, ctx: int, touched: dict[str, list[int]]) -> dict[str, float]:
    """Bytes one step must move (see the module docstring), split by what. Parameters count at their own
    dtype: FP8 weights 1 byte per value plus their float32 block scales."""
    from atom_models.moe import Experts, Fp8Experts

    cfg, k = engine.config, engine.engine_config.num_speculative_tokens
    q = 1 + k

    def weights(mod, skip: tuple = ()) -> tuple[float, float]:
        dense, per_expert = 0.0, 0.0
        for m in mod.modules():
            if isinstance(m, (Experts, Fp8Experts)):  # one (pseudo-)expert's slice of every stacked tensor
                per_expert = sum(p[0].numel() * p.element_size() for p in m.parameters())
        for name, p in mod.named_parameters():
            if "experts." in name or any(s in name for s in skip):
                continue
            dense += p.numel() * p.element_size()
        return dense, per_expert

    emb = engine.target.model.embed_tokens.weight
    lm = engine.target.lm_head.weight
    row = emb.shape[1] * emb.element_size()
    t_dense, per_expert = weights(engine.target, skip=("embed_tokens", "lm_head"))
    out = {
        "target_weights": t_dense + lm.numel() * lm.element_size() + batch * q * row,
        "target_experts": sum(touched["target"]) * per_expert,
    }
    gdn = engine.caches.gdn_bytes_per_seq()
    out["gdn_state"] = batch * (2 * gdn["ssm"] + 2 * gdn["conv"] + 2 * gdn["pending"])
    kv_tok = (
        2
        * engine.caches.layout.num_kv_heads
        * cfg.head_dim
        * next(iter(engine.caches.kv.values()))[0].element_size()
    )
    n_attn = len(cfg.full_attention_layers)
    out["kv"] = batch * n_attn * (ctx + q) * kv_tok
    if engine.mtp is not None and k > 0:
        m_dense, _ = weights(engine.mtp, skip=("embed_tokens", "lm_head"))
        out["mtp_weights"] = k * (m_dense + lm.numel() * lm.element_size()) + batch * (q + k) * row
        out["mtp_experts"] = sum(touched["mtp"]) * per_expert
        out["kv"] += batch * cfg.num_mtp_layers * k * (ctx + 2 * q) * kv_tok
    return out


def time_steps(engine, n: int, sync) -> float:
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_breakdown(engine, n: int, sync) -> dict:
    """Median milliseconds per graphed step in each host phase (wall clock around the engine's own calls,
    no added synchronisation): ``schedule``, ``fill`` (metadata staging + its one copy; absent from the steps
    that run over the metadata the previous step advanced on the device), ``target_launch`` /
    ``propose_launch`` (the CPU side of the graph replays), ``read`` (result copy, the wait for the GPU,
    ``tolist``), ``finish`` (the scheduler's end of step), ``other`` (the rest of ``step``: the per-request
    bookkeeping) and ``step``. The GPU runs from the first launch to the end of ``read``'s wait, so every
    other phase is time the GPU sits idle in a step."""
    g, sched = engine.graphs, engine.scheduler
    phases: dict[str, list[float]] = {}
    acc: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] = acc.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

        return wrapper

    saved = (
        sched.schedule,
        sched.finish_step,
        g.meta.fill,
        g.reader.read,
        dict(g._targets),
        dict(g._proposers),
    )
    sched.schedule = timed("schedule", sched.schedule)
    sched.finish_step = timed("finish", sched.finish_step)
    g.meta.fill = timed("fill", g.meta.fill)
    g.reader.read = timed("read", g.reader.read)
    g._targets = {key: timed("target_launch", e) for key, e in g._targets.items()}
    g._proposers = {key: timed("propose_launch", e) for key, e in g._proposers.items()}
    try:
        for _ in range(n):
            sync()
            acc.clear()
            t0 = time.perf_counter()
            engine.step()
            step = (time.perf_counter() - t0) * 1e3
            sync()
            acc["other"] = step - sum(acc.values())
            acc["step"] = step
            for name, v in acc.items():
                phases.setdefault(name, []).append(v)
    finally:
        sched.schedule, sched.finish_step, g.meta.fill, g.reader.read = saved[:4]
        g._targets, g._proposers = saved[4], saved[5]
    return {name: statistics.median(v) for name, v in phases.items()}


def gpu_ms(fn, smoke: bool) -> float:
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return common.time_ms(fn, warmup_ms=10, rep_ms=40)


def bench_k(args, cfg, k: int, device, dtype, ceil, rows: list, prof_out: Path | None) -> None:
    from atom_models.engine import EngineConfig, LLMEngine

    smoke = args.smoke
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    max_tokens = 4 * args.steps * (1 + k) + 32
    ec = EngineConfig(
        num_speculative_tokens=k,
        max_num_seqs=max(args.batches),
        max_model_len=args.ctx + max_tokens,
        cuda_graphs=True,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(cfg, ec, dtype=dtype, device=device)
    randomize(engine, seed=k)
    params = {id(p): p for m in (engine.target, engine.mtp) if m is not None for p in m.parameters()}
    weights_gb = sum(p.numel() * p.element_size() for p in params.values()) / 1e9
    print(
        f"k={k}: engine built and randomized in {time.perf_counter() - t0:.1f} s, weights {weights_gb:.2f} GB",
        flush=True,
    )
    for b in args.batches:
        place_running(engine, b, args.ctx, max_tokens, seed=b)
        touched = count_touched_experts(engine)
        fb = floor_bytes(engine, b, args.ctx, touched)
        nbytes = sum(fb.values())
        floor = nbytes / (ceil["copy_gbps"] * 1e9) * 1e3
        t_floor = (fb["target_weights"] + fb["target_experts"] + fb["gdn_state"]) / (ceil["copy_gbps"] * 1e6)
        graphs = engine.graphs
        engine.runner.graphs = None
        eager_step = time_steps(engine, args.steps, sync)
        engine.runner.graphs = graphs
        time_steps(engine, 2, sync)  # capture this bucket
        graph_step = time_steps(engine, args.steps, sync)
        host = host_breakdown(engine, args.steps, sync)
        q, bucket = 1 + k, graphs.bucket(b)
        entry = graphs._targets[(q, bucket)]
        target_graph = gpu_ms(entry, smoke)
        target_eager = gpu_ms(entry.body, smoke)
        prop = graphs._proposers.get((k, bucket))
        propose_graph = gpu_ms(prop, smoke) if prop is not None else None
        propose_eager = gpu_ms(prop.body, smoke) if prop is not None else None
        r = {
            "bench": "engine_step",
            "case": f"k={k} B={b}",
            "k": k,
            "B": b,
            "ctx": args.ctx,
            "weights_gb": weights_gb,
            "step_ms_eager": eager_step,
            "step_ms_graphed": graph_step,
            "target_ms_eager": target_eager,
            "target_ms_graphed": target_graph,
            "propose_ms_eager": propose_eager,
            "propose_ms_graphed": propose_graph,
            "floor_ms": floor,
            "target_floor_ms": t_floor,
            "floor_bytes": fb,
            "experts_touched": touched,
            "frac_floor_step_graphed": floor / graph_step,
            "frac_floor_step_eager": floor / eager_step,
            "frac_floor_model_graphed": floor / (target_graph + (propose_graph or 0.0)),
            "host_ms_graphed": host,
        }
        rows.append(r)
        print(
            f"k={k} B={b}: step eager {eager_step:.2f} ms graphed {graph_step:.2f} ms | target eager "
            f"{target_eager:.3f} graphed {target_graph:.3f} | propose {propose_graph} | floor {floor:.3f} ms "
            f"({floor / graph_step:.0%} of the graphed step)\n  host phases per graphed step (ms): "
            + " ".join(f"{name} {v:.3f}" for name, v in host.items()),
            flush=True,
        )
        if prof_out is not None and k == 1 and b in args.profile_batches:
            r["profile"] = profile_step(engine, prof_out.with_name(f"{prof_out.stem}_k1_b{b}.txt"), device)
        clear_running(engine)
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_step(engine, path: Path, device) -> dict:
    """CUDA kernel time of one graphed step (after one unprofiled step), by kernel, to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    engine.step()
    with profile(activities=acts) as prof:
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    avgs = prof.key_averages()
    table = avgs.table(sort_by=sort, row_limit=40, max_name_column_width=70)
    kernels = [e for e in avgs if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    launches = sum(e.count for e in kernels)
    summary = f"one graphed step: {launches} GPU kernels/copies, {busy:.3f} ms of GPU time\n"
    path.write_text(summary + table)
    print(summary + table[:3000], flush=True)
    return {"gpu_kernels": launches, "gpu_busy_ms": busy}


def tiny_tokens_per_s(device, dtype, smoke: bool) -> list[dict]:
    import json

    from atom_core.paths import default_model_dir, reference_dir
    from atom_models.engine import EngineConfig, LLMEngine, SamplingParams

    prompts = [
        p["prompt_token_ids"] for p in json.loads((reference_dir() / "prompts.json").read_text())["prompts"]
    ]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for conc in (1, 16):
        for graphs in (False, True):
            eng = LLMEngine.from_pretrained(
                default_model_dir(),
                EngineConfig(
                    num_speculative_tokens=1, max_num_seqs=16, max_model_len=512, cuda_graphs=graphs
                ),
                dtype=dtype,
                device=device,
            )
            n_tok = 8 if smoke else 128
            eng.generate(prompts[:conc], SamplingParams(max_tokens=n_tok, ignore_eos=True))  # warm-up
            sync()
            t0 = time.perf_counter()
            res = eng.generate(prompts[:conc], SamplingParams(max_tokens=n_tok, ignore_eos=True))
            sync()
            wall = time.perf_counter() - t0
            n = sum(len(r.output_ids) for r in res)
            acc = sum(r.stats.num_accepted_tokens for r in res) / max(
                1, sum(r.stats.num_draft_tokens for r in res)
            )
            out.append(
                {
                    "concurrency": conc,
                    "cuda_graphs": graphs,
                    "tokens": n,
                    "s": wall,
                    "tok_s": n / wall,
                    "acceptance": acc,
                }
            )
            print(
                f"tiny model k=1 concurrency {conc} graphs {graphs}: {n / wall:.0f} tok/s (acceptance {acc:.2f})"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ks", type=int, nargs="+", default=None, help="default: 0 1 3")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 64 256")
    ap.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default=None,
        help="default: auto (--fp8: fp8, the seed's)",
    )
    ap.add_argument("--ctx", type=int, default=1024, help="context tokens per sequence")
    ap.add_argument("--steps", type=int, default=6, help="timed engine steps per case")
    ap.add_argument(
        "--profile-batches",
        type=int,
        nargs="*",
        default=None,
        help="profiled at k=1 (default 1 64; --fp8: none)",
    )
    ap.add_argument("--fp8", action="store_true", help="FP8 weights at the full 48 layers (module docstring)")
    ap.add_argument("--layers", type=int, default=None, help="target layers (default 8; --fp8: 48)")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny model's tokens/s (--fp8: skipped)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    args = ap.parse_args()
    out = common.out_dir(args.out)
    fp8 = args.fp8
    args.ks = args.ks or [0, 1, 3]
    args.batches = args.batches or [1, 8, 64, 256]
    args.kv_cache_dtype = args.kv_cache_dtype or ("fp8" if fp8 else "auto")
    if args.profile_batches is None:
        args.profile_batches = [] if fp8 else [1, 64]
    layers = args.layers or (FP8_LAYERS if fp8 else WIDE["num_hidden_layers"])
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        cfg = model_config({**SMOKE, "num_hidden_layers": args.layers or SMOKE["num_hidden_layers"]}, fp8)
        ceil = {"copy_gbps": 10.0, "matmul_tflops": 0.1}
        args.batches, args.ctx, args.steps = [b for b in args.batches if b <= 8] or [1, 8], 32, 2
        args.profile_batches = args.batches[-1:] if args.profile_batches else []
    else:
        device, dtype = common.require_cuda(), torch.bfloat16
        cfg = model_config({**WIDE, "num_hidden_layers": layers}, fp8)
        ceil = common.ceilings(out, device)
    name = f"engine_{common.gpu_tag(device)}" + ("_fp8" if fp8 else "")
    if layers != (FP8_LAYERS if fp8 else WIDE["num_hidden_layers"]):
        name += f"_{layers}layers"
    torch.manual_seed(0)
    rows: list[dict] = []
    t_start = time.perf_counter()
    with torch.no_grad():
        for k in args.ks:
            bench_k(args, cfg, k, device, dtype, ceil, rows, out / "engine_profile.txt")
            gc.collect()  # the graphs hold reference cycles to the engine's models: free them now
            if device.type == "cuda":
                torch.cuda.empty_cache()
            common.write_json(out / f"{name}.json", {"ceilings": ceil, "rows": rows, "partial": True})
    by = {(r["k"], r["B"]): r for r in rows}
    for r in rows:
        d = by.get((0, r["B"]))
        if d and r["k"] > 0:
            r["target_vs_decode_graphed"] = r["target_ms_graphed"] / d["target_ms_graphed"]
            r["step_vs_decode_graphed"] = r["step_ms_graphed"] / d["step_ms_graphed"]
        if r["k"] == 1:  # tokens/s at the seed's measured acceptance length: per stream, and all B streams
            per_stream = SEED_ACCEPTANCE_LENGTH / r["step_ms_graphed"] * 1e3
            r["projected_stream_tokens_per_s"] = per_stream
            r["projected_total_tokens_per_s"] = per_stream * r["B"]
    tiny = []
    if not (fp8 or args.no_tiny):
        tiny = tiny_tokens_per_s(device, torch.bfloat16 if not args.smoke else torch.float32, args.smoke)
    payload = {
        "env": common.environment() if not args.smoke else {},
        "model": {
            "layers": cfg.num_hidden_layers,
            "mtp_layers": cfg.num_mtp_layers,
            "weights": "fp8 e4m3 (128x128 block scales)" if fp8 else str(dtype),
            "activations": str(dtype),
        },
        "ceilings": ceil,
        "rows": rows,
        "tiny": tiny,
        "wall_s": time.perf_counter() - t_start,
    }
    if device.type == "cuda":
        payload["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    common.write_json(out / f"{name}.json", payload)
    common.print_table(
        rows,
        ["case", "step_ms_eager", "step_ms_graphed", "target_ms_eager", "target_ms_graphed", "propose_ms_graphed",
         "floor_ms", "frac_floor_step_graphed", "frac_floor_model_graphed", "target_vs_decode_graphed"],
    )  # fmt: skip
    plot = [
        {"case": r["case"], "impl": impl, "frac": r["floor_ms"] / r[key]}
        for r in rows
        for impl, key in (("eager step", "step_ms_eager"), ("graphed step", "step_ms_graphed"))
    ]
    what = f"{cfg.num_hidden_layers} layers, {'FP8 weights' if fp8 else 'bf16'}"
    common.plot_rows(
        out / f"{name}.png", plot, value="frac", title=f"engine step: floor / time (80B width, {what})",
        xlabel="fraction of the bandwidth floor",
    )  # fmt: skip


if __name__ == "__main__":
    main()
