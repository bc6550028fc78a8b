"""Small ops at the Qwen3-Next-80B-A3B shapes (bf16), H200: Triton backend vs the torch reference.

- ``rms_norm`` over hidden 2048, with and without the fused residual add;
- ``gated_rms_norm`` (GDN output norm): 32 value heads x 128;
- ``rope``: q [T, 16, 256], k [T, 2, 256], rotary_dim 64 (partial rotary 0.25), theta 1e7;
- ``qk_norm+rope``: per-head q/k RMS norm then RoPE, done as rms_norm(q), rms_norm(k), rope (Triton, three
  launches) and with the torch reference (a fused Triton version measured slower and was removed);
- ``silu_and_mul`` on [T, 2 x 512] (shared-expert width);
- ``moe_router``: softmax top-10 of 512 (fused, one launch) vs torch softmax + topk + renormalise.
Bytes: every input read once and every output written once. Timing: ``do_bench`` (L2 flushed; eager,
so the smallest sizes show launch cost).

Usage: python benchmarks/gpu/bench_small_ops.py [--out DIR] [--quick]
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that made them)
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

H, HQ, HKV, D, ROT, THETA = 2048, 16, 2, 256, 64, 1e7
HV, DV = 32, 128


def main() -> None:
    args, out, device, ceil = common.bench_setup(__doc__)
    tri = common.backend_ops(
        "triton", device, ["rms_norm", "gated_rms_norm", "rope", "silu_and_mul", "moe_router"]
    )
    ref = common.backend_ops(
        "reference", device, ["rms_norm", "gated_rms_norm", "rope", "silu_and_mul", "moe_router"]
    )
    bf = dict(device=device, dtype=torch.bfloat16)
    rows = []

    def add(op, T, impl, fn, nbytes, check=None):
        err = None
        try:
            if check is not None:
                a, b = check
                a = a if isinstance(a, tuple) else (a,)
                b = b if isinstance(b, tuple) else (b,)
                err = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
                if not err < 0.1:
                    print(f"{op} T={T}: {impl} differs from the reference by {err:.3e} (timed anyway)")
            ms = common.time_ms(fn)
        except Exception as exc:  # record and go on
            print(f"{op} T={T} {impl} failed: {exc}")
            rows.append(dict(bench="small_ops", case=f"{op} T={T}", impl=impl, ms=None, error=str(exc)[:300]))
            return
        rows.append(common.row(bench="small_ops", case=f"{op} T={T}", impl=impl, ms=ms, ceil=ceil, nbytes=nbytes,
                               max_err_vs_reference=err))  # fmt: skip

    for T in [64, 4096, 32768] if not args.quick else [4096]:
        try:
            x = torch.randn(T, H, **bf)
            r = torch.randn(T, H, **bf)
            w = torch.randn(H, **bf) * 0.1
            for name, k in (("triton", tri), ("torch reference", ref)):
                add("rms_norm", T, name, lambda k=k: k.rms_norm(x, w, 1e-6), 2 * T * H * 2,
                    (k.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)))  # fmt: skip
                add("rms_norm+residual", T, name, lambda k=k: k.rms_norm(x, w, 1e-6, r), 4 * T * H * 2,
                    (k.rms_norm(x, w, 1e-6, r), ref.rms_norm(x, w, 1e-6, r)))  # fmt: skip
            xg = torch.randn(T, HV, DV, **bf)
            zg = torch.randn(T, HV, DV, **bf)
            wg = torch.randn(DV, **bf)
            for name, k in (("triton", tri), ("torch reference", ref)):
                add("gated_rms_norm", T, name, lambda k=k: k.gated_rms_norm(xg, zg, wg, 1e-6), 3 * xg.numel() * 2,
                    (k.gated_rms_norm(xg, zg, wg, 1e-6), ref.gated_rms_norm(xg, zg, wg, 1e-6)))  # fmt: skip
            q = torch.randn(T, HQ, D, **bf)
            kk = torch.randn(T, HKV, D, **bf)
            pos = torch.randint(0, 32768, (T,), device=device)
            qkb = 2 * (q.numel() + kk.numel()) * 2
            for name, k in (("triton", tri), ("torch reference", ref)):
                add("rope", T, name, lambda k=k: k.rope(q, kk, pos, ROT, THETA), qkb,
                    (k.rope(q, kk, pos, ROT, THETA), ref.rope(q, kk, pos, ROT, THETA)))  # fmt: skip
            qw = torch.randn(D, **bf) * 0.1
            kw = torch.randn(D, **bf) * 0.1

            def unfused(k):
                return k.rope(k.rms_norm(q, qw, 1e-6), k.rms_norm(kk, kw, 1e-6), pos, ROT, THETA)

            expect = unfused(ref)
            add(
                "qk_norm+rope",
                T,
                "triton unfused (3 launches)",
                lambda: unfused(tri),
                qkb,
                (unfused(tri), expect),
            )
            add("qk_norm+rope", T, "torch reference", lambda: unfused(ref), qkb)
            xs = torch.randn(T, 2 * 512, **bf)
            for name, k in (("triton", tri), ("torch reference", ref)):
                add("silu_and_mul", T, name, lambda k=k: k.silu_and_mul(xs), xs.numel() * 2 * 3 // 2,
                    (k.silu_and_mul(xs), ref.silu_and_mul(xs)))  # fmt: skip
            logits = torch.randn(T, 512, **bf)
            for name, k in (("triton", tri), ("torch reference", ref)):
                add(
                    "moe_router",
                    T,
                    name,
                    lambda k=k: k.moe_router(logits, 10, True),
                    logits.numel() * 2 + T * 10 * 12,
                )
        except Exception as exc:  # record and go on with the next size
            import traceback

            traceback.print_exc()
            rows.append(
                dict(bench="small_ops", case=f"T={T}", impl="(failed)", ms=None, error=str(exc)[:400])
            )
    common.write_json(
        out / "small_ops_h200.json", {"env": common.environment(), "ceilings": ceil, "rows": rows}
    )
    common.plot_rows(out / "small_ops_h200.png", rows, value="frac_copy",
                     title="Small ops, Qwen3-Next-80B shapes, bf16: fraction of copy BW",
                     xlabel="fraction of measured device copy bandwidth")  # fmt: skip
    common.print_table(rows, ["case", "impl", "ms", "gbps", "frac_copy"])


if __name__ == "__main__":
    main()
