"""Paged attention at the Qwen3-Next-80B-A3B shapes (TP 1: 16 query / 2 KV heads, head_dim 256), H200.

Cases: decode (1 query token) and verification (1 + k, k = 1..4) at batch 1, 8, 64, 256 and context
1k, 8k, 32k; prefill of 4096 tokens; a prefill chunk over a cached prefix; a mixed batch; the FP8 cache.
Each case times the Triton kernel (atom_kernels triton backend, bf16 paged cache, block size 16) and,
in the same run, torch SDPA (flash) on K/V already gathered into dense tensors (the gather is not timed;
GQA through ``enable_gqa``; verification uses the lower-right causal mask, which torch sends to flash).

Timing: CUDA-graph replay of R back-to-back calls on R independent caches (R chosen so the caches of
one replay exceed 4x the 60 MB L2), divided by R: no launch gaps and no L2-resident K/V. Bytes: K and
V of every context token read once, plus q and out. FLOPs: 4 * Q * Hq * ctx * D per sequence (causal:
the kept half for prefill).

Usage: python benchmarks/gpu/bench_attention.py [--out DIR] [--quick]
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that made them)
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HQ, HKV, D = 16, 2, 256
BLOCK = 16
L2_BYTES = 60e6


def make_paged(batch, ctx, block, dtype, device, gen_seed):
    """Random paged K/V for ``batch`` sequences of ``ctx`` tokens; block tables a random permutation."""
    g = torch.Generator(device=device).manual_seed(gen_seed)
    nblk_seq = math.ceil(ctx / block)
    nblocks = batch * nblk_seq + 1
    kc = torch.randn((nblocks, block, HKV, D), device=device, dtype=torch.bfloat16, generator=g)
    vc = torch.randn((nblocks, block, HKV, D), device=device, dtype=torch.bfloat16, generator=g)
    if dtype != torch.bfloat16:
        kc, vc = kc.to(dtype), vc.to(dtype)
    perm = torch.randperm(nblocks - 1, device=device, generator=g)[: batch * nblk_seq]
    bt = perm.reshape(batch, nblk_seq).int()
    return kc, vc, bt


def dense_kv(kc, vc, bt, ctx):
    """[B, Hkv, ctx, D] gathered copies for SDPA."""
    block = kc.shape[1]
    idx = torch.arange(ctx, device=kc.device)
    slots = bt[:, idx // block].long() * block + idx % block
    k = kc.reshape(-1, HKV, D)[slots].permute(0, 2, 1, 3).contiguous()
    v = vc.reshape(-1, HKV, D)[slots].permute(0, 2, 1, 3).contiguous()
    return k, v


def sdpa(q4, k, v, q_len, ctx, scale, lower_right=True):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        if q_len == 1 or not lower_right:  # not lower_right: same cost, no mask (fallback only)
            return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
        if q_len == ctx:
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(
            q4, k, v, attn_mask=causal_lower_right(q_len, ctx), scale=scale, enable_gqa=True
        )


def guarded(label, fn, *args, **kwargs):
    """Run one case; a failure is printed and recorded as a row instead of ending the whole run."""
    import traceback

    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        traceback.print_exc()
        return [
            dict(
                bench="attention",
                case=label,
                impl="(failed)",
                ms=None,
                error=f"{type(exc).__name__}: {exc}"[:400],
            )
        ]


def graph_ms(calls):
    def run():
        for c in calls:
            c()

    return common.time_ms(run, graph=True, rep_ms=20) / len(calls)


def check(out, ref, what):
    err = (out.float() - ref.float()).abs().max().item()
    if not err < 5e-2:
        raise ValueError(f"{what}: Triton and SDPA outputs differ by {err:.3e}")
    return err


def bench_uniform(kern, ceil, batch, ctx, q_lens, device, cache_dtype=torch.bfloat16, block=BLOCK, tag=""):
    """Decode/verify rows for one (batch, ctx): one set of caches reused for every q_len."""
    kv_bytes = batch * ctx * HKV * D * 2 * kc_elem(cache_dtype)
    reps = max(1, min(64, math.ceil(4 * L2_BYTES / kv_bytes)))
    caches = [make_paged(batch, ctx, block, cache_dtype, device, 1 + r) for r in range(reps)]
    dense = [dense_kv(*c, ctx) for c in caches] if cache_dtype == torch.bfloat16 else None
    scale = D**-0.5
    kv_scale = torch.tensor([0.5], device=device) if cache_dtype != torch.bfloat16 else None
    rows = []
    for q_len in q_lens:
        qs = [torch.randn(batch * q_len, HQ, D, device=device, dtype=torch.bfloat16) for _ in range(reps)]
        seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
        qsl = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * q_len
        ours = [
            (
                lambda q=q, c=c: kern.paged_attention(
                    q, c[0], c[1], c[2], seq_lens, qsl, scale, kv_scale, kv_scale
                )
            )
            for q, c in zip(qs, caches)
        ]
        name = f"{'decode' if q_len == 1 else f'verify k={q_len - 1}'} B={batch} ctx={ctx // 1024}k{tag}"
        nbytes = kv_bytes + 2 * batch * q_len * HQ * D * 2
        flops = 4.0 * batch * q_len * HQ * ctx * D
        err = None
        if dense is not None:
            q4s = [q.view(batch, q_len, HQ, D).transpose(1, 2) for q in qs]
            mode = "gqa"
            try:
                ref = sdpa(q4s[0], *dense[0], q_len, ctx, scale).transpose(1, 2).reshape(batch * q_len, HQ, D)
            except RuntimeError as exc:  # flash refused GQA / the lower-right mask: time a same-cost call
                print(f"{name}: SDPA flash with enable_gqa failed ({exc}); baseline folds heads into queries")
                mode = "folded"
            if mode == "gqa":
                try:
                    err = check(ours[0](), ref, name)
                except ValueError as exc:
                    print(exc)
                    err = str(exc)
            if mode == "gqa":
                base = [
                    (lambda q4=q4, d=d: sdpa(q4, d[0], d[1], q_len, ctx, scale)) for q4, d in zip(q4s, dense)
                ]
                impl = "torch SDPA flash (dense K/V)"
            else:  # [B, Hkv, Q*G, D] queries, no mask: the same bytes and FLOPs
                qf = [q.view(batch, q_len, HKV, HQ // HKV, D).permute(0, 2, 1, 3, 4).reshape(batch, HKV, -1, D)
                      for q in qs]  # fmt: skip
                base = [(lambda a=a, d=d: sdpa(a, d[0], d[1], 1, ctx, scale)) for a, d in zip(qf, dense)]
                impl = "torch SDPA flash (dense K/V, heads folded, unmasked)"
            try:
                rows.append(common.row(bench="attention", case=name, impl=impl, ms=graph_ms(base), ceil=ceil,
                                       nbytes=nbytes, flops=flops, reps=reps))  # fmt: skip
            except Exception as exc:
                rows.append(common.row(bench="attention", case=name, impl=impl, ms=None, ceil=ceil,
                                       error=f"{type(exc).__name__}: {exc}"[:300]))  # fmt: skip
        rows.append(common.row(bench="attention", case=name, impl="triton paged", ms=graph_ms(ours), ceil=ceil,
                               nbytes=nbytes, flops=flops, reps=reps, max_err_vs_sdpa=err))  # fmt: skip
        print(
            name,
            *(
                f"{r['impl']}: {r['ms'] * 1e3:.1f} us ({r['frac_copy']:.0%} BW)"
                for r in rows[-2:]
                if r["case"] == name and r["ms"]
            ),
        )
    del caches, dense
    torch.cuda.empty_cache()
    return rows


def kc_elem(dtype):
    return torch.tensor([], dtype=dtype).element_size()


def bench_prefill(kern, ceil, device, new, prefix):
    ctx = new + prefix
    kc, vc, bt = make_paged(1, ctx, BLOCK, torch.bfloat16, device, 7)
    k, v = dense_kv(kc, vc, bt, ctx)
    q = torch.randn(new, HQ, D, device=device, dtype=torch.bfloat16)
    seq_lens = torch.tensor([ctx], device=device, dtype=torch.int32)
    qsl = torch.tensor([0, new], device=device, dtype=torch.int32)
    scale = D**-0.5
    q4 = q.view(1, new, HQ, D).transpose(1, 2)
    name = f"prefill {new}" + (f" over {prefix} cached" if prefix else "")
    flops = 4.0 * HQ * D * (new * prefix + new * (new + 1) / 2)
    nbytes = 2 * ctx * HKV * D * 2 + 2 * new * HQ * D * 2
    try:
        ref = sdpa(q4, k, v, new, ctx, scale).transpose(1, 2).reshape(new, HQ, D)
    except RuntimeError as exc:
        print(f"{name}: SDPA failed ({exc})")
        ref = None
    rows = []
    for label, cfg in [("triton paged", None),
                       ("triton paged BLOCK_N=64 w8", dict(BLOCK_N=64, num_warps=8)),
                       ("triton paged BLOCK_Q=8 BLOCK_N=64 w8", dict(BLOCK_Q=8, BLOCK_N=64, num_warps=8)),
                       ("triton paged BLOCK_Q=8 BLOCK_N=32 w4 s3", dict(BLOCK_Q=8, BLOCK_N=32, num_warps=4, num_stages=3))]:  # fmt: skip
        fn = lambda cfg=cfg: kern_paged(kern, q, kc, vc, bt, seq_lens, qsl, scale, cfg)  # noqa: E731
        try:
            err = check(fn(), ref, name) if ref is not None else None
            ms = common.time_ms(fn)
        except Exception as exc:  # an unsupported tile config (e.g. out of shared memory) is a result too
            rows.append(common.row(bench="attention", case=name, impl=label, ms=None, ceil=ceil,
                                   error=f"{type(exc).__name__}: {exc}"[:300]))  # fmt: skip
            continue
        rows.append(common.row(bench="attention", case=name, impl=label, ms=ms, ceil=ceil, nbytes=nbytes,
                               flops=flops, max_err_vs_sdpa=err))  # fmt: skip
    if ref is not None:
        rows.append(common.row(bench="attention", case=name, impl="torch SDPA flash (dense K/V)",
                               ms=common.time_ms(lambda: sdpa(q4, k, v, new, ctx, scale)), ceil=ceil,
                               nbytes=nbytes, flops=flops))  # fmt: skip
    for r in rows:
        print(name, r["impl"], f"{r['ms'] * 1e3:.0f} us {r.get('tflops', 0):.0f} TFLOP/s" if r["ms"] else r)
    return rows


def kern_paged(kern, q, kc, vc, bt, seq_lens, qsl, scale, cfg):
    from atom_kernels.ops.paged_attention import triton as pa

    if cfg is None:
        return kern.paged_attention(q, kc, vc, bt, seq_lens, qsl, scale)
    return pa.paged_attention(q, kc, vc, bt, seq_lens, qsl, scale, config=cfg)


SWEEP = {  # alternatives to the default plan, timed on a few cases (same run, same inputs)
    1: [("BLOCK_N=64 s3", dict(BLOCK_N=64, num_stages=3)), ("BLOCK_N=32 s4", dict(BLOCK_N=32, num_stages=4)),
        ("BLOCK_N=128 w8", dict(BLOCK_N=128, num_warps=8))],
    5: [("BLOCK_N=32 w4 s3", dict(BLOCK_N=32, num_warps=4, num_stages=3)),
        ("BLOCK_N=64 w4", dict(BLOCK_N=64, num_warps=4)), ("BLOCK_N=64 w8 s3", dict(BLOCK_N=64, num_warps=8, num_stages=3))],
}  # fmt: skip


def bench_sweep(ceil, device, batch, ctx):
    """Tile alternatives for decode (q_len 1) and k=4 verification (q_len 5) at one (batch, ctx)."""
    from atom_kernels.ops.paged_attention import triton as pa

    kc, vc, bt = make_paged(batch, ctx, BLOCK, torch.bfloat16, device, 11)
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    scale = D**-0.5
    rows = []
    for q_len, variants in SWEEP.items():
        q = torch.randn(batch * q_len, HQ, D, device=device, dtype=torch.bfloat16)
        seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
        qsl = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * q_len
        name = f"{'decode' if q_len == 1 else f'verify k={q_len - 1}'} B={batch} ctx={ctx // 1024}k"
        ref = pa.paged_attention(q, kc, vc, bt, seq_lens, qsl, scale)
        for label, cfg in [("default", None), *variants]:
            fn = lambda cfg=cfg: pa.paged_attention(q, kc, vc, bt, seq_lens, qsl, scale, config=cfg)  # noqa: E731
            try:
                err = (fn().float() - ref.float()).abs().max().item()
                ms = common.time_ms(fn, graph=True, rep_ms=20)
            except Exception as exc:
                rows.append(
                    dict(bench="attention_sweep", case=name, impl=label, ms=None, error=str(exc)[:300])
                )
                continue
            rows.append(common.row(bench="attention_sweep", case=name, impl=f"triton paged {label}", ms=ms,
                                   ceil=ceil, nbytes=kv_bytes, flops=0.0, max_err_vs_default=err))  # fmt: skip
            print("sweep", name, label, f"{ms * 1e3:.1f} us", f"{rows[-1]['frac_copy']:.0%}")
    return rows


def bench_mixed(kern, ceil, device):
    """One prefill chunk of 1024 over 7168 cached tokens + 63 decodes + 64 k=3 verifies, ctx 8k."""
    ctx = 8192
    q_lens = [1024] + [1] * 63 + [4] * 64
    batch = len(q_lens)
    kc, vc, bt = make_paged(batch, ctx, BLOCK, torch.bfloat16, device, 9)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), HQ, D, device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    scale = D**-0.5
    out = kern.paged_attention(q, kc, vc, bt, seq_lens, qsl, scale)
    k, v = dense_kv(kc, vc, bt, ctx)
    errs = []
    for n in (0, 1, 64, batch - 1):  # spot-check each kind of sequence against SDPA
        a, b = int(qsl[n]), int(qsl[n + 1])
        q4 = q[a:b].view(1, b - a, HQ, D).transpose(1, 2)
        ref = sdpa(q4, k[n : n + 1], v[n : n + 1], b - a, ctx, scale).transpose(1, 2).reshape(b - a, HQ, D)
        errs.append((out[a:b].float() - ref.float()).abs().max().item())
    nbytes = batch * ctx * HKV * D * 2 * 2
    flops = 4.0 * HQ * D * sum(ql * ctx for ql in q_lens)
    ms = common.time_ms(
        lambda: kern.paged_attention(q, kc, vc, bt, seq_lens, qsl, scale), graph=True, rep_ms=20
    )
    r = common.row(bench="attention", case="mixed: 1x1024 prefill chunk + 63 decode + 64 verify k=3, ctx 8k",
                   impl="triton paged", ms=ms, ceil=ceil, nbytes=nbytes, flops=flops, max_err_vs_sdpa=max(errs))  # fmt: skip
    print(r["case"], f"{ms * 1e3:.0f} us, {r['frac_copy']:.0%} BW, {r['tflops']:.0f} TFLOP/s")
    return [r]


def main() -> None:
    args, out, device, ceil = common.bench_setup(__doc__, quick_help="fewer cases (smoke test)")
    kern = common.backend_ops("triton", device, ["paged_attention"])
    rows = []
    batches = [1, 8, 64, 256] if not args.quick else [8]
    ctxs = [1024, 8192, 32768] if not args.quick else [8192]
    q_lens = [1, 2, 3, 4, 5] if not args.quick else [1, 4]
    for b in batches:
        for c in ctxs:
            rows += guarded(f"B={b} ctx={c}", bench_uniform, kern, ceil, b, c, q_lens, device)
    rows += guarded(
        "fp8", bench_uniform, kern, ceil, 64, 8192, [1, 2], device, torch.float8_e4m3fn, tag=" fp8"
    )
    rows += guarded("block64", bench_uniform, kern, ceil, 8, 32768, [1, 2], device, block=64, tag=" block64")
    rows += guarded("prefill 4096", bench_prefill, kern, ceil, device, 4096, 0)
    rows += guarded("prefill chunk", bench_prefill, kern, ceil, device, 2048, 6144)
    rows += guarded("mixed", bench_mixed, kern, ceil, device)
    if not args.quick:
        rows += guarded("sweep B=64 ctx=8k", bench_sweep, ceil, device, 64, 8192)
        rows += guarded("sweep B=8 ctx=32k", bench_sweep, ceil, device, 8, 32768)
    common.write_json(
        out / "attention_h200.json", {"env": common.environment(), "ceilings": ceil, "rows": rows}
    )
    dec = [r for r in rows if r["case"].startswith(("decode", "verify")) and r["bench"] == "attention"]
    common.plot_rows(out / "attention_h200.png", dec, value="frac_copy",
                     title="Paged attention decode/verify, Qwen3-Next-80B TP1 (16q/2kv, D=256), fraction of copy BW",
                     xlabel="fraction of measured device copy bandwidth")  # fmt: skip
    common.print_table(rows, ["case", "impl", "ms", "gbps", "frac_copy", "tflops", "frac_matmul"])


if __name__ == "__main__":
    main()
