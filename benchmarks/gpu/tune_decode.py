"""Launch-config sweep of the FP8 decode linear and the FP8 MoE pair path at the 80B-A3B decode shapes.

Decode linear (``fp8_linear`` / ``gated_norm_fp8_linear``, configs through ``plan(..., config=...)``) at the
80B checkpoint's FP8 projections (TP1): GDN ``in_proj_qkvz`` 2048 -> 12288, attention ``qkv_proj`` (q with
gate, k, v fused) 2048 -> 9216, attention ``o_proj`` 4096 -> 2048, and GDN ``out_proj`` 4096 -> 2048 with
its gated-norm prologue; M = 1, 2, 4, 8 tokens. Per (shape, M) it times the default plan, the one-launch
plan's default tiles, a bounded grid of one-launch configs (column tile x split-K at 2 warps / 4 stages;
warps x stages around the 32- and 64-column tiles; the unswapped dot) and the three-launch plan with two
column tiles, each config reduced to its effective split and deduplicated.

MoE (``moe_experts_fp8`` pair path: 512 routed experts + the shared expert as expert 512, top-10 + 1,
H = 2048, I = 512) at T = 1, 2, 4, 8 tokens: the first GEMM's column tile / warps / stages with the second
at its default, then the second's with the first at its default, then the two best together; the aligned
path as a reference row.

Every config's output is compared with the default config's output (same inputs) within the op's bf16
tolerance (``TOL``); a config outside it is reported and never picked as best. Times are CUDA-graph
replays (``common.time_ms(graph=True)``) of calls that rotate over copies of the weights (at least
``ROTATE_L2`` x the device's L2 in all) or, for the MoE, over 8 routings: weights come from HBM, not L2.
Bytes: weights (+ block scales) + activations in + out (MoE: the distinct experts a routing touches);
``frac_copy``: bytes / time / this run's measured device copy bandwidth.

Compiles: every config is a Triton compile. Before timing, worker processes (``--workers``) run each
distinct config once on a small problem with the same specialisation (same constexprs, same M, same
divisibilities), filling Triton's on-disk cache in parallel; the timing process then loads the compiled
kernels. A wall-clock budget (``--budget-s``, from the start of the run) bounds the whole run: workers stop
at ``COMPILE_SHARE`` of it, the sweep stops ``RESERVE_S`` before its end, and the JSON (rewritten after
each case) holds whatever was measured. Order of work: M = 1, 2, the MoE at T = 1, 2, 4, then M = 4, 8 and
T = 8.

Output: ``tune_decode_<gpu>.json`` in ``--out`` / ``$OUT``: ``rows`` (every timing), ``linear`` and
``moe`` (per case: default, best, best config, fractions of copy bandwidth), ``decode_table`` (the best
one-launch config per (N, K, ROWS) of the plain linear, in the form ``fp8.triton.decode_table`` reads).

Usage: python benchmarks/gpu/tune_decode.py [--out DIR] [--budget-s 210] [--workers N] [--ms 1,2,4,8] [--ts 1,2,4,8]
       (``--ts ""`` / ``--ms ""``: the linear part / the MoE part only)
       TRITON_INTERPRET=1 python benchmarks/gpu/tune_decode.py --smoke   # CPU, tiny shapes, 2 configs each
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that made them)
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

E4M3 = torch.float8_e4m3fn
GROUP = 128  # block-FP8 128 x 128
LINEARS = {  # name -> (N, K, gated-norm prologue): the 80B-A3B's FP8 decode projections (TP1)
    "gdn in_proj_qkvz": (12288, 2048, False),
    "attn qkv_proj": (9216, 2048, False),
    "attn o_proj": (2048, 4096, False),
    "gdn out_proj (gated norm)": (2048, 4096, True),
}
SMOKE_LINEARS = {"smoke linear": (128, 512, False), "smoke gated": (128, 256, True)}
MOE = dict(E=512, TOP_K=10, H=2048, I=512)
SMOKE_MOE = dict(E=6, TOP_K=2, H=256, I=128)
ROUTINGS = 8  # routings each MoE timing rotates over
ROTATE_L2 = 4  # the rotated weight copies of a linear timing hold at least this many L2s
REP_MS = 5  # per-config time of each timed graph replay (common.time_ms)
COMPILE_SHARE = 0.4  # share of the budget the compile workers may take
RESERVE_S = 6.0  # stop timing this long before the budget ends (JSON write, exit)
# (atol, rtol) of a config's output against the default config's, on the same inputs. bf16: the op's bf16
# tolerance against the reference (packages/atom-kernels/tests: ("linear", bf16), ("moe_fp8", bf16,
# "triton")); float32 (the CPU smoke run, interpreter): split-K order only, the op's float32 triton bound.
TOL = {
    ("linear", torch.bfloat16): (2e-2, 1e-2),
    ("linear", torch.float32): (2e-3, 1e-3),
    ("moe", torch.bfloat16): (5e-2, 2e-2),
    ("moe", torch.float32): (3e-2, 2e-2),
}


# ----------------------------------------------------------------------------------------------- configs
def _key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def linear_configs(m: int, n: int, k: int, sms: int, smoke: bool) -> list[dict]:
    """Default plan first, then the one-launch defaults, the grid and the three-launch variants; each
    one-launch config's SPLIT_K reduced to the split the launch makes of it; duplicates dropped."""
    from atom_kernels.ops.fp8 import triton as fp8

    default = fp8.plan(m, n, k, GROUP, sms)
    one = fp8.plan(m, n, k, GROUP, sms, {"ONE_LAUNCH": True})
    three = fp8.plan(m, n, k, GROUP, sms, {"ONE_LAUNCH": False})
    if smoke:
        grid = [dict(BLOCK_N=32, SPLIT_K=2), dict(BLOCK_N=64, SPLIT_K=1, SWAP_AB=False, num_warps=4)]
        threes = []
    else:
        grid = [dict(SWAP_AB=True, BLOCK_N=bn, SPLIT_K=sk, num_warps=2, num_stages=4)
                for bn in (16, 32, 64, 128) for sk in (1, 2, 4, 8)]  # fmt: skip
        grid += [dict(SWAP_AB=True, BLOCK_N=bn, SPLIT_K=sk, num_warps=w, num_stages=s)
                 for bn in (32, 64) for sk in (2, 4) for w, s in ((1, 4), (4, 4), (2, 3), (2, 6))]  # fmt: skip
        grid += [dict(SWAP_AB=False, BLOCK_N=bn, SPLIT_K=sk, num_warps=4, num_stages=4)
                 for bn in (32, 64, 128) for sk in (1, 4)]  # fmt: skip
        threes = [three, {**three, "BLOCK_N": 64}, {**three, "BLOCK_N": 128}]
    groups = -(-k // GROUP)
    out, seen = [], set()
    for cfg in [default, one, *({**one, **g} for g in grid), *threes]:
        if cfg["ONE_LAUNCH"]:
            per = -(-groups // max(1, min(int(cfg["SPLIT_K"]), groups)))
            cfg = {**cfg, "SPLIT_K": -(-groups // per)}
        if _key(cfg) not in seen:
            seen.add(_key(cfg))
            out.append(cfg)
    return out


def moe_configs(smoke: bool) -> tuple[dict, list[dict], list[dict]]:
    """(default pair tiles, first-GEMM variants, second-GEMM variants); variants hold the changed keys."""
    from atom_kernels.ops.moe.triton_fp8_decode import PAIR_TILES

    default = dict(PAIR_TILES)
    if smoke:
        return default, [dict(PN1=16, PW1=1)], [dict(PN2=32, PS2=2)]
    g1 = [dict(PN1=bn, PW1=w, PS1=s) for bn in (16, 32, 64, 128) for w in (1, 2, 4) for s in (2, 4)]
    g2 = [dict(PN2=bn, PW2=w, PS2=s) for bn in (32, 64, 128, 256) for w in (1, 2, 4) for s in (2, 3)]
    same = lambda g: all(default[a] == b for a, b in g.items())  # noqa: E731
    return default, [g for g in g1 if not same(g)], [g for g in g2 if not same(g)]


# ------------------------------------------------------------------------------------------------ inputs
def block_fp8(shape: tuple[int, ...], device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 weights ``[..., N, K]`` with float32 block scales ``[..., N/128, K/128]`` such that
    ``w * scale`` has entries of size ~K^-0.5 (outputs of size ~1 for unit activations)."""
    g = torch.Generator(device=device).manual_seed(seed)
    *lead, n, k = shape
    w = (torch.randn(shape, device=device, generator=g) * 32).clamp(-448, 448).to(E4M3)
    s = torch.rand((*lead, -(-n // GROUP), -(-k // GROUP)), device=device, generator=g) + 0.5
    return w, s * (k**-0.5 / 32)


class LinearCase:
    """One projection at one M: activations, ``copies`` weight copies (each with its split-K tickets)."""

    def __init__(self, n, k, gated, m, dtype, device, copies):
        g = torch.Generator(device=device).manual_seed(1000 + m)
        self.n, self.k, self.gated, self.m = n, k, gated, m
        self.x = torch.randn((m, k), device=device, dtype=torch.float32, generator=g).to(dtype)
        self.z = torch.randn((m, k), device=device, dtype=torch.float32, generator=g).to(dtype)
        self.norm_w = (1 + 0.1 * torch.randn(GROUP, device=device, generator=g)).to(dtype)
        self.weights = [block_fp8((n, k), device, seed=c) for c in range(copies)]
        self.tickets = [torch.zeros(n // 16 + 1, dtype=torch.int32, device=device) for _ in range(copies)]
        self.nbytes = (
            n * k
            + self.weights[0][1].numel() * 4
            + (m * k * (2 if gated else 1) + m * n) * (self.x.element_size())
        )

    def call(self, cfg: dict, copy: int = 0) -> torch.Tensor:
        from atom_kernels.ops.fp8 import triton as fp8

        w, s = self.weights[copy]
        if self.gated:
            o = self.x.view(self.m, self.k // GROUP, GROUP)
            z = self.z.view(self.m, self.k // GROUP, GROUP)
            return fp8.gated_norm_fp8_linear(
                o, z, self.norm_w, 1e-6, w, s, tickets=self.tickets[copy], config=cfg
            )
        return fp8.fp8_linear(self.x, w, s, tickets=self.tickets[copy], config=cfg)

    def rotated(self, cfg: dict):
        return lambda: [self.call(cfg, c) for c in range(len(self.weights))]


class MoeCase:
    """``T`` tokens routed ``ROUTINGS`` ways over ``E`` experts + the shared one (expert ``E``)."""

    def __init__(self, t, shape, dtype, device, weights, routings):
        top_k, h, inter = shape["TOP_K"], shape["H"], shape["I"]
        self.w13, self.s13, self.w2, self.s2 = weights
        e = self.w13.shape[0] - 1
        g = torch.Generator(device=device).manual_seed(2000 + t)
        self.t = t
        self.x = torch.randn((t, h), device=device, generator=g).to(dtype)
        self.routes = []
        for _ in range(routings):
            wts, ids = torch.softmax(torch.randn((t, e), device=device, generator=g), -1).topk(top_k, -1)
            shared = torch.full((t, 1), e, dtype=ids.dtype, device=device)
            gate = torch.sigmoid(torch.randn((t, 1), device=device, generator=g))
            self.routes.append(
                (torch.cat([wts / wts.sum(-1, keepdim=True), gate], 1), torch.cat([ids, shared], 1))
            )
        self.tickets = torch.zeros(8 * -(-h // 16), dtype=torch.int32, device=device)
        per_expert = 3 * inter * h + (self.s13[0].numel() + self.s2[0].numel()) * 4
        touched = sum(torch.unique(ids).numel() for _, ids in self.routes) / routings
        self.nbytes = touched * per_expert + 2 * t * h * self.x.element_size()

    def call(self, cfg: dict, route: int = 0) -> torch.Tensor:
        from atom_kernels.ops.moe import triton_fp8

        wts, ids = self.routes[route]
        return triton_fp8.moe_experts_fp8(
            self.x, wts, ids, self.w13, self.s13, self.w2, self.s2, tickets=self.tickets, config=cfg
        )

    def rotated(self, cfg: dict):
        return lambda: [self.call(cfg, r) for r in range(len(self.routes))]


def moe_weights(shape: dict, device, experts: int | None = None) -> tuple[torch.Tensor, ...]:
    """``(w13, s13, w2, s2)`` of ``experts`` (default ``shape["E"]``) routed experts + the shared one."""
    e, h, inter = (experts or shape["E"]) + 1, shape["H"], shape["I"]
    return (*block_fp8((e, 2 * inter, h), device, seed=11), *block_fp8((e, h, inter), device, seed=12))


# ------------------------------------------------------------------------------------------------- tasks
def plan_tasks(sms: int, smoke: bool, ms: list[int], ts: list[int]) -> list[dict]:
    """Every (case, config) of the run in the order it is timed (M <= 2, then T <= 4, then the larger M,
    then the larger T); the compile workers take the same list."""
    linears = SMOKE_LINEARS if smoke else LINEARS
    ms_first, ms_later = [m for m in ms if m <= 2], [m for m in ms if m > 2]
    ts_first, ts_later = [t for t in ts if t <= 4], [t for t in ts if t > 4]
    default, g1, g2 = moe_configs(smoke)
    moe_cfgs = [default, *({**default, **g} for g in g1 + g2), {"PAIRS": False}]

    def lin(ms):
        return [dict(kind="linear", name=name, n=n, k=k, gated=gated, m=m, cfg=cfg)
                for m in ms for name, (n, k, gated) in linears.items()
                for cfg in linear_configs(m, n, k, sms, smoke)]  # fmt: skip

    def moe(ts):
        return [dict(kind="moe", t=t, cfg=cfg) for t in ts for cfg in moe_cfgs]

    return lin(ms_first) + moe(ts_first) + lin(ms_later) + moe(ts_later)


def compile_signature(task: dict) -> tuple:
    """What makes a distinct Triton compile (approximately: over-splitting only duplicates work)."""
    if task["kind"] == "moe":
        return ("moe", _key(task["cfg"]))
    one = task["cfg"].get("ONE_LAUNCH")
    return ("linear", task["gated"], task["m"] == 1, task["m"] if not one else 0, _key(task["cfg"]))


def compile_worker(args) -> None:
    """Run each task of this shard once on small inputs (one weight copy; 16 experts): Triton compiles
    and caches the kernels on disk for the timing process."""
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tasks = json.loads(Path(args.compile_worker).read_text())
    mine = tasks[args.shard :: args.nshards]
    moe_shape = SMOKE_MOE if args.smoke else MOE
    made: dict = {}
    done = 0
    for task in mine:
        if time.time() > args.until:
            break
        try:
            if task["kind"] == "linear":
                key = ("linear", task["n"], task["k"], task["gated"], task["m"])
                if key not in made:
                    made[key] = LinearCase(task["n"], task["k"], task["gated"], task["m"], dtype, device, 1)
                made[key].call(task["cfg"])
            else:
                key = ("moe", task["t"])
                if key not in made:
                    weights = made.setdefault("moe", moe_weights(moe_shape, device, experts=16))
                    made[key] = MoeCase(task["t"], moe_shape, dtype, device, weights, routings=1)
                made[key].call(task["cfg"])
            done += 1
        except Exception as exc:  # the timing process records the failure
            print(f"[compile {args.shard}] {task.get('name', 'moe')} {task['cfg']}: {exc}"[:300], flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"[compile {args.shard}] {done}/{len(mine)} tasks", flush=True)


def start_workers(tasks, nworkers, out: Path, until: float, smoke: bool) -> list[subprocess.Popen]:
    if nworkers <= 0:
        return []
    uniq, seen = [], set()
    for t in tasks:
        sig = compile_signature(t)
        if sig not in seen:
            seen.add(sig)
            uniq.append(t)
    path = out / "tune_decode_tasks.json"
    path.write_text(json.dumps(uniq))
    print(f"compiling {len(uniq)} distinct configs of {len(tasks)} tasks in {nworkers} workers", flush=True)
    argv = [sys.executable, __file__, "--compile-worker", str(path), "--nshards", str(nworkers),
            "--until", str(until)] + (["--smoke"] if smoke else [])  # fmt: skip
    return [subprocess.Popen(argv + ["--shard", str(i)]) for i in range(nworkers)]


# ------------------------------------------------------------------------------------------------ timing
class Sweep:
    def __init__(self, device, dtype, ceil, deadline, smoke):
        self.device, self.dtype, self.ceil, self.deadline, self.smoke = device, dtype, ceil, deadline, smoke
        self.rows: list[dict] = []
        self.stopped = False

    def left(self) -> bool:
        if time.monotonic() >= self.deadline - RESERVE_S:
            self.stopped = True
        return not self.stopped

    def time_ms(self, fn) -> float:
        if self.smoke:  # interpreter: one call's wall time (checks the plumbing, not a measurement)
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return common.time_ms(fn, graph=True, rep_ms=REP_MS)

    def measure(self, bench, case, cfg, ref, call, rotated, per_call, nbytes, tol) -> dict:
        """One config: output vs the default's (``ref``), then its time per call."""
        r = dict(bench=bench, case=case, config=cfg, ms=None)
        try:
            y = call(cfg).float()
            diff = (y - ref).abs()
            r["max_diff_vs_default"] = diff.max().item()
            r["ok"] = bool((diff <= tol[0] + tol[1] * ref.abs()).all().item())
            r["ms"] = self.time_ms(rotated(cfg)) / per_call
            r["gbps"] = nbytes / (r["ms"] * 1e-3) / 1e9
            r["frac_copy"] = r["gbps"] / self.ceil["copy_gbps"]
        except Exception as exc:
            r["ok"], r["error"] = False, f"{type(exc).__name__}: {exc}"[:300]
        self.rows.append(r)
        return r


def summarize(case, rows, default_cfg, extra) -> dict:
    good = [r for r in rows if r["ok"] and r["ms"]]
    dflt = next((r for r in rows if r["config"] == default_cfg and r["ms"]), None)
    best = min(good, key=lambda r: r["ms"]) if good else None
    s = dict(case=case, configs_timed=len([r for r in rows if r["ms"]]),
             configs_failed=[r["config"] for r in rows if not r["ok"]], **extra,
             default_us=dflt["ms"] * 1e3 if dflt else None, default_frac_copy=dflt["frac_copy"] if dflt else None,
             default_config=default_cfg, best_us=best["ms"] * 1e3 if best else None,
             best_frac_copy=best["frac_copy"] if best else None, best_config=best["config"] if best else None)  # fmt: skip
    s["default_over_best"] = s["default_us"] / s["best_us"] if dflt and best else None
    return s


def sweep_linear(sw: Sweep, tasks, copies_for) -> dict | None:
    """Tasks of one (shape, M), default first: times every config, then the default again (drift)."""
    t0 = tasks[0]
    n, k, gated, m = t0["n"], t0["k"], t0["gated"], t0["m"]
    case = f"{t0['name']} N={n} K={k} M={m}"
    lc = LinearCase(n, k, gated, m, sw.dtype, sw.device, copies_for(n * k))
    per_call = len(lc.weights)
    ref = lc.call(t0["cfg"]).float()
    tol = TOL[("linear", sw.dtype)]
    rows = []
    for task in tasks:
        if not sw.left():
            break
        rows.append(
            sw.measure("linear", case, task["cfg"], ref, lc.call, lc.rotated, per_call, lc.nbytes, tol)
        )
    again = sw.measure("linear", case, t0["cfg"], ref, lc.call, lc.rotated, per_call, lc.nbytes, tol) if (
        sw.left()
    ) else {"ms": None}  # fmt: skip
    from atom_kernels.ops.fp8 import triton as fp8

    one = fp8.plan(m, n, k, GROUP, 1, {"ONE_LAUNCH": True})  # ROWS only (independent of the SM count)
    one_row = next((r for r in rows if r["config"].get("ONE_LAUNCH") and r is not rows[0]), None)
    s = summarize(case, rows, t0["cfg"], dict(n=n, k=k, m=m, gated=gated, rows=one["ROWS"], bytes=lc.nbytes,
                                                weight_copies=per_call))  # fmt: skip
    s["default_plan"] = "one-launch" if t0["cfg"]["ONE_LAUNCH"] else "3-launch"
    s["default_again_us"] = again["ms"] * 1e3 if again["ms"] else None
    good_one = [r for r in rows if r["ok"] and r["ms"] and r["config"].get("ONE_LAUNCH")]
    if good_one:
        b = min(good_one, key=lambda r: r["ms"])
        s["best_one_launch_us"], s["best_one_launch_config"] = b["ms"] * 1e3, b["config"]
    if one_row is not None and not t0["cfg"]["ONE_LAUNCH"]:
        s["one_launch_default_us"] = one_row["ms"] * 1e3 if one_row["ms"] else None
    del lc
    return s


def sweep_moe(sw: Sweep, t: int, shape: dict, weights, smoke: bool) -> dict | None:
    default, g1, g2 = moe_configs(smoke)
    case = f"moe T={t} E={shape['E']}+1 top-{shape['TOP_K']}+1 H={shape['H']} I={shape['I']}"
    mc = MoeCase(t, shape, sw.dtype, sw.device, weights, routings=2 if smoke else ROUTINGS)
    ref = mc.call(default).float()
    tol = TOL[("moe", sw.dtype)]
    args = (ref, mc.call, mc.rotated, len(mc.routes), mc.nbytes, tol)
    rows = [sw.measure("moe", case, default, *args)]

    def best_of(variants):
        found = []
        for g in variants:
            if not sw.left():
                break
            r = sw.measure("moe", case, {**default, **g}, *args)
            rows.append(r)
            if r["ok"] and r["ms"]:
                found.append((r["ms"], g))
        return min(found, key=lambda f: f[0])[1] if found else {}

    b1, b2 = best_of(g1), best_of(g2)
    if b1 and b2 and sw.left():
        rows.append(sw.measure("moe", case, {**default, **b1, **b2}, *args))
    aligned = sw.measure("moe", case, {"PAIRS": False}, *args) if sw.left() else None
    s = summarize(case, rows, default, dict(t=t, bytes=mc.nbytes))
    s["aligned_path_us"] = aligned["ms"] * 1e3 if aligned and aligned["ms"] else None
    again = sw.measure("moe", case, default, *args) if sw.left() else {"ms": None}
    s["default_again_us"] = again["ms"] * 1e3 if again["ms"] else None
    del mc
    return s


def table_entries(linear: list[dict], rows: list[dict]) -> list[dict]:
    """``decode_table`` entries (``atom_kernels.ops.fp8.decode_table``): per ``(N, K, ROWS)``, the one-launch
    config with the least summed time over the cases that plan reads that key for (M = 1 and 2 share
    ``ROWS = 2``; the plain and gated 4096 -> 2048 projections share ``(2048, 4096)``), among configs valid
    and timed in all of them; only where that sum beats the default plans' sum."""
    groups: dict[tuple, list[dict]] = {}
    for s in linear:
        groups.setdefault((s["n"], s["k"], s["rows"]), []).append(s)
    entries = []
    for (n, k, nrows), cases in groups.items():
        names = {c["case"] for c in cases}
        times: dict[tuple, dict[str, list[float]]] = {}
        for r in rows:
            if (
                r["bench"] == "linear"
                and r["case"] in names
                and r["ok"]
                and r["ms"]
                and r["config"]["ONE_LAUNCH"]
            ):
                times.setdefault(_key(r["config"]), {}).setdefault(r["case"], []).append(r["ms"] * 1e3)
        sums = {
            key: sum(sum(v) / len(v) for v in per.values())
            for key, per in times.items()
            if len(per) == len(names)
        }
        if not sums or any(c["default_us"] is None for c in cases):
            continue
        key = min(sums, key=sums.get)
        default_sum = sum(c["default_us"] for c in cases)
        if sums[key] < default_sum:
            cfg = {
                a: b
                for a, b in key
                if a in ("ONE_LAUNCH", "BLOCK_N", "SPLIT_K", "SWAP_AB", "num_warps", "num_stages")
            }
            entries.append(dict(n=n, k=k, rows=nrows, config=cfg, us_sum=sums[key], default_us_sum=default_sum,
                                cases=sorted(names)))  # fmt: skip
    return entries


def progress(s: dict) -> None:
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{s['case']}: default {s.get('default_plan', '')} {f(s['default_us'], '.1f')}us, best "
          f"{f(s['best_us'], '.1f')}us ({f(s['best_frac_copy'], '.0%')} of copy) {s['best_config']}", flush=True)  # fmt: skip


def cpu_copy_gbps() -> float:
    src = torch.randn(8 << 20)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 5 * 2 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    start = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=210.0, help="wall-clock cap of the whole run")
    ap.add_argument(
        "--workers", type=int, default=None, help="compile workers (default: CPUs - 2, at most 12)"
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, 2 configs")
    ap.add_argument("--ms", default=None, help="linear token counts, comma list (default 1,2,4,8; smoke 1,2)")
    ap.add_argument("--ts", default=None, help="MoE token counts, comma list (default 1,2,4,8; smoke 1,2); "
                    "an empty string skips the part")  # fmt: skip
    ap.add_argument("--compile-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--nshards", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile_worker:
        return compile_worker(args)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    deadline = start + args.budget_s
    out = common.out_dir(args.out)
    if args.smoke:
        device, dtype, sms = torch.device("cpu"), torch.float32, 4
        nworkers = 0 if args.workers is None else args.workers
    else:
        device, dtype = common.require_cuda(), torch.bfloat16
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        nworkers = min(12, (os.cpu_count() or 4) - 2) if args.workers is None else args.workers

    def counts(arg: str | None) -> list[int]:
        text = ("1,2" if args.smoke else "1,2,4,8") if arg is None else arg
        return [int(v) for v in text.split(",") if v.strip()]

    tasks = plan_tasks(sms, args.smoke, counts(args.ms), counts(args.ts))
    distinct = len({compile_signature(t) for t in tasks})
    until = time.time() + COMPILE_SHARE * args.budget_s - (time.monotonic() - start)
    workers = start_workers(tasks, nworkers, out, until, args.smoke)
    if args.smoke:
        copies_for = lambda _nbytes: 2  # noqa: E731
    else:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
        copies_for = lambda nbytes: max(2, min(32, math.ceil(ROTATE_L2 * l2 / nbytes)))  # noqa: E731
    for w in workers:  # the workers stop by themselves at `until`
        try:
            w.wait(timeout=max(1.0, until - time.time() + 15))
        except subprocess.TimeoutExpired:
            w.kill()
    compile_s = time.monotonic() - start
    # measured once the workers are done (their launches would share the device)
    ceil = {"copy_gbps": cpu_copy_gbps()} if args.smoke else common.ceilings(out, device)
    sw = Sweep(device, dtype, ceil, deadline, args.smoke)
    linear, moe = [], []
    name = f"tune_decode_{common.gpu_tag(device)}.json"

    def save():
        table = table_entries(linear, sw.rows)
        common.write_json(out / name, dict(
            env=common.environment(), ceilings=ceil, budget_s=args.budget_s, compile_workers=nworkers,
            compile_phase_s=compile_s, elapsed_s=time.monotonic() - start, stopped_by_budget=sw.stopped,
            tasks=len(tasks), distinct_compiles=distinct, linear=linear, moe=moe, decode_table=table, rows=sw.rows))  # fmt: skip

    i, moe_w = 0, None
    moe_shape = SMOKE_MOE if args.smoke else MOE
    while i < len(tasks) and sw.left():
        task = tasks[i]
        try:
            if task["kind"] == "linear":
                j = i
                same = lambda t: t["kind"] == "linear" and (t["name"], t["m"]) == (task["name"], task["m"])  # noqa: E731
                while j < len(tasks) and same(tasks[j]):
                    j += 1
                s = sweep_linear(sw, tasks[i:j], copies_for)
                linear.append(s)
                progress(s)
            else:
                j = i
                while j < len(tasks) and tasks[j]["kind"] == "moe" and tasks[j]["t"] == task["t"]:
                    j += 1
                if moe_w is None:
                    moe_w = moe_weights(moe_shape, device)
                s = sweep_moe(sw, task["t"], moe_shape, moe_w, args.smoke)
                moe.append(s)
                progress(s)
        except Exception:
            traceback.print_exc()
        i = j if j > i else i + 1
        save()
    save()
    print(f"\ncopy {ceil['copy_gbps']:.0f} GB/s; compile phase {compile_s:.0f}s; total {time.monotonic() - start:.0f}s"
          f"{' (stopped by the budget)' if sw.stopped else ''}; {len(sw.rows)} timings -> {out / name}")  # fmt: skip
    common.print_table(linear, ["case", "default_plan", "default_us", "default_again_us", "best_us",
                                "default_over_best", "default_frac_copy", "best_frac_copy", "best_config"])  # fmt: skip
    print()
    common.print_table(moe, ["case", "default_us", "default_again_us", "best_us", "default_over_best",
                             "aligned_path_us", "default_frac_copy", "best_frac_copy", "best_config"])  # fmt: skip


if __name__ == "__main__":
    main()
