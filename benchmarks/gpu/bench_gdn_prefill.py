"""GDN chunked prefill: our ``gated_delta_rule_chunked`` against fla-core's ``chunk_gated_delta_rule`` doing
the same work, in one run, with a breakdown of where the difference goes.

Same inputs as ``bench_gdn.py``'s prefill cases (Qwen3-Next-80B GDN layer, 1 x 4096 and 16 x 512 tokens,
float32 and bf16 state pools, odd sequences with an initial state). Implementations, all timed in every
case after every one of them has been warmed up in that case (fla-core autotunes on the first call of a
new autotune key, and its keys include the dtype of every tensor argument, ``cu_seqlens`` too):

- ``triton``: our op (state pool in, state pool out), as vLLM calls it.
- ``triton-run4``: an earlier form of the wrapper (``has_initial_state.to(int8)``: one more launch).
- ``fla-i32``: fla-core alone on dense float32 states, given our very ``cu_seqlens`` (int32): the same
  kernels and autotune keys as inside ``triton``; the floor for our wrapper (no pool gather/scatter).
- ``fla-i64``: as ``fla-i32`` with an int64 copy of ``cu_seqlens`` made once (the baseline ``bench_gdn.py``
  used before): other autotune keys, so fla-core may run other configurations than in ``triton``.
- ``fla+index``: what a caller of fla-core needs for a slot pool, in torch: gather with indexing, fla-core
  (int32 ``cu_seqlens``), ``index_copy_`` of the final states (same work as ``triton``).
- ``gather`` / ``scatter``: our two pool kernels alone.

Columns: ``ms`` (median, CUDA events, L2 flushed: ``common.time_ms`` eager, as ``bench_gdn.py``), ``host_ms``
(Python/launch time per call: 30 calls issued without waiting), ``gpu_ms`` (sum of the kernels' device
time per call, torch.profiler), ``rounds`` (``ms`` of each interleaved round: the spread). Checks: ``triton``
equals ``fla-i32`` exactly (same kernels on the same values) and matches the float32 reference with
``bench_gdn.TOL``. Writes ``<out>/gdn_prefill.json``; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_gdn import TOL  # noqa: E402
from gdn_harness import BF16, FP32, QWEN3_NEXT_80B, close, fla_ops, get_impl, max_err  # noqa: E402

ROUNDS = 3


def inputs(dev: torch.device, sd: torch.dtype, N: int, L: int):
    """The tensors of bench_gdn.GdnRun.chunked (same seed, same values)."""
    sh = QWEN3_NEXT_80B
    gen = torch.Generator(device=dev).manual_seed(7 * N + L)
    T = N * L
    q = torch.randn(T, sh.hk, sh.dk, generator=gen, device=dev).to(BF16)
    k = torch.randn(T, sh.hk, sh.dk, generator=gen, device=dev).to(BF16)
    v = torch.randn(T, sh.hv, sh.dv, generator=gen, device=dev).to(BF16)
    g = -torch.rand(T, sh.hv, generator=gen, device=dev) * 0.5
    beta = torch.rand(T, sh.hv, generator=gen, device=dev)
    cu = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
    S = 2 * N
    idx = torch.randperm(S, generator=gen, device=dev)[:N].to(torch.int32)
    has = torch.arange(N, device=dev) % 2 == 1
    pool = (torch.randn(S, sh.hv, sh.dv, sh.dk, generator=gen, device=dev) * 0.5).to(sd)
    return q, k, v, g, beta, cu, idx, has, pool


def host_ms(fn, calls: int = 30) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def gpu_ms(fn, calls: int = 10) -> tuple[float, list[tuple[str, float, int]]]:
    """Device time of the kernels per call, and (kernel, us per call, launches per call) by kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            per.setdefault(e.name[:60], []).append(e.device_time_total)
    table = sorted(((n, sum(t) / calls, len(t) // calls) for n, t in per.items()), key=lambda x: -x[1])
    return sum(t for _, t, _ in table) / 1e3, table


def autotune_state() -> list[dict]:
    """Every fla-core autotuner's chosen config per key (which configs ran where)."""
    from triton.runtime.autotuner import Autotuner

    out = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            fn = obj
            while fn is not None and not isinstance(fn, Autotuner):
                fn = getattr(fn, "fn", None)
            if isinstance(fn, Autotuner) and fn.cache:
                for key, cfg in fn.cache.items():
                    out.append({"kernel": f"{name}.{attr}", "key": str(key), "config": str(cfg)})
    uniq = {(r["kernel"], r["key"]): r for r in out}
    return sorted(uniq.values(), key=lambda r: (r["kernel"], r["key"]))


def case(dev, sd, N, L, rows, checks, breakdown) -> None:
    from atom_kernels.ops.gated_delta_rule import triton as gdr_triton
    from atom_kernels.ops.gated_delta_rule.checks import check_gated_delta_rule_chunked

    sh = QWEN3_NEXT_80B
    SCALE = sh.scale
    q, k, v, g, beta, cu, idx, has, pool = inputs(dev, sd, N, L)
    name = f"{N}x{L} state={str(sd)[6:]}"
    tri = get_impl("gated_delta_rule_chunked", "triton", dev, BF16)
    ref32 = get_impl("gated_delta_rule_chunked", "reference", dev, FP32)
    _, fla = fla_ops()
    if tri is None or fla is None:
        raise RuntimeError("triton gated_delta_rule_chunked or fla-core unavailable")
    HV, DV, DK = pool.shape[1:]
    numel, BLOCK = HV * DV * DK, 2048
    grid = (N, triton.cdiv(numel, BLOCK))
    il = idx.long()
    h0 = pool[il].float() * has[:, None, None, None]
    cu64 = cu.long()
    h0buf = torch.empty_like(h0)
    init8 = has.view(torch.int8)
    final_buf = torch.randn_like(h0)

    def fla_call(cu_arg, h):
        return fla(
            q[None], k[None], v[None], g[None], beta[None], scale=SCALE, initial_state=h,
            output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True, cu_seqlens=cu_arg,
        )  # fmt: skip

    def run4(pool_):
        check_gated_delta_rule_chunked(q, k, v, g, beta, cu, pool_, idx, has, SCALE, True, 64)
        h = torch.empty((N, HV, DV, DK), dtype=torch.float32, device=dev)
        init = has.to(torch.int8)
        gdr_triton._gather_states_kernel[grid](
            pool_, idx, init, h, pool_.stride(0), h.stride(0), numel, BLOCK=BLOCK
        )
        o, fin = fla_call(cu, h)
        fin = fin.contiguous()
        gdr_triton._scatter_states_kernel[grid](
            fin, idx, pool_, fin.stride(0), pool_.stride(0), numel, BLOCK=BLOCK
        )
        return o.squeeze(0).to(q.dtype)

    def fla_index(pool_):
        h = pool_[il].float() * has[:, None, None, None]
        o, fin = fla_call(cu, h)
        pool_.index_copy_(0, il, fin.to(pool_.dtype))
        return o.squeeze(0)

    # checks: ours equals fla-core on the same values (int32 cu: the same kernels), and the reference
    pool_t = pool.clone()
    o_t = tri(q, k, v, g, beta, cu, pool_t, idx, has, SCALE, True, 64)
    o_f, fin_f = fla_call(cu, h0.clone())
    same_o = torch.equal(o_t, o_f.squeeze(0))
    same_s = torch.equal(pool_t[il], fin_f.to(sd))
    checks.append({"what": "triton == fla-i32 (o, states)", "case": name, "ok": same_o and same_s,
                   "max_abs_err": max(max_err(o_t, o_f.squeeze(0)), max_err(pool_t[il], fin_f.to(sd)))})  # fmt: skip
    pool_r = pool.float()
    o_r = ref32(q.float(), k.float(), v.float(), g, beta, cu, pool_r, idx, has, SCALE, True, 64)
    for what, got, exp in (("chunked_out", o_t, o_r), ("chunked_state", pool_t[il].float(), pool_r[il])):
        tol = TOL[(what, sd)]
        checks.append(
            {"what": what, "case": name, "ok": close(got, exp, tol), "max_abs_err": max_err(got, exp)}
        )
    del pool_r, o_r, pool_t

    impls = {
        "triton": lambda: tri(q, k, v, g, beta, cu, pool, idx, has, SCALE, True, 64),
        "triton-run4": lambda: run4(pool),
        "fla-i32": lambda: fla_call(cu, h0),
        "fla-i64": lambda: fla_call(cu64, h0),
        "fla+index": lambda: fla_index(pool),
        "gather": lambda: gdr_triton._gather_states_kernel[grid](
            pool, idx, init8, h0buf, pool.stride(0), h0buf.stride(0), numel, BLOCK=BLOCK
        ),
        "scatter": lambda: gdr_triton._scatter_states_kernel[grid](
            final_buf, idx, pool, final_buf.stride(0), pool.stride(0), numel, BLOCK=BLOCK
        ),
        "check": lambda: check_gated_delta_rule_chunked(
            q, k, v, g, beta, cu, pool, idx, has, SCALE, True, 64
        ),
    }
    first = {}
    for impl, fn in impls.items():  # warm-up per configuration: autotune / compile outside the timings
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first[impl] = (time.perf_counter() - t0) * 1e3
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    per_round: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(ROUNDS):
        for impl, fn in impls.items():
            per_round[impl].append(common.time_ms(fn, warmup_ms=10, rep_ms=50))
    for impl, fn in impls.items():
        h_ms = host_ms(fn)
        g_ms, table = gpu_ms(fn)
        ms = statistics.median(per_round[impl])
        rows.append({"case": name, "impl": impl, "ms": ms, "host_ms": h_ms, "gpu_ms": g_ms,
                     "first_call_ms": first[impl], "rounds": [round(x, 4) for x in per_round[impl]],
                     "N": N, "L": L, "state_dtype": str(sd)[6:]})  # fmt: skip
        print(f"  {name:22s} {impl:12s} ms {ms:.4f}  host {h_ms:.4f}  gpu {g_ms:.4f}  first {first[impl]:.1f}"
              f"  rounds {[round(x, 4) for x in per_round[impl]]}", flush=True)  # fmt: skip
        if impl in ("triton", "fla-i32", "fla-i64"):
            breakdown.append({"case": name, "impl": impl, "kernels": table})
            for kname, us, n in table:
                print(f"      {us:9.1f} us x{n}  {kname}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="ignored (accepted so run_all.sh --bench-args can be shared)")
    args = ap.parse_args()
    out = common.out_dir(args.out)
    dev = common.require_cuda()
    rows: list[dict] = []
    checks: list[dict] = []
    breakdown: list[dict] = []
    failed = False
    for sd in (FP32, BF16):
        for N, L in QWEN3_NEXT_80B.prefills:
            try:
                case(dev, sd, N, L, rows, checks, breakdown)
            except Exception:
                import traceback

                traceback.print_exc()
                failed = True
            torch.cuda.empty_cache()
    tuned = autotune_state()
    common.write_json(
        out / "gdn_prefill.json",
        {
            "env": common.environment(),
            "rows": rows,
            "checks": checks,
            "kernels": breakdown,
            "autotune": tuned,
        },
    )
    print("\nfla-core autotune choices (kernel, key, config):")
    for r in tuned:
        print(f"  {r['kernel']}  {r['key']}  {r['config']}")
    print()
    common.print_table(rows, ["case", "impl", "ms", "host_ms", "gpu_ms", "first_call_ms"])
    print("\nratios (same run): triton / fla-i32, triton / fla-i64, triton / fla+index")
    t = {(r["case"], r["impl"]): r["ms"] for r in rows}
    for c in dict.fromkeys(r["case"] for r in rows):
        tri = t.get((c, "triton"))
        if tri:
            rs = [tri / t[(c, b)] for b in ("fla-i32", "fla-i64", "fla+index") if t.get((c, b))]
            print(f"  {c:22s} " + "  ".join(f"{x:.3f}" for x in rs))
    bad = [c for c in checks if not c["ok"]]
    for c in checks:
        print(f"  check {c['what']:30s} {c['case']:22s} ok={c['ok']} max_abs_err={c['max_abs_err']:.3e}")
    print(f"\nchecks: {len(checks) - len(bad)} ok, {len(bad)} failed")
    sys.exit(1 if failed or bad else 0)


if __name__ == "__main__":
    main()
