"""Decoder-layer input at decode sizes: ``rms_norm_fp8_linear``'s one launch against ``rms_norm`` + ``fp8_linear``.

Shapes of Qwen3-Next-80B-A3B (hidden K = 2048, bf16 activations, a float32 residual stream as the model
keeps it, e4m3 weights with 128 x 128 block scales), M = 1, 2, 4, 8 tokens:

- ``in_proj_qkvz`` N = 12288 (GDN layers), ``in_proj_ba`` N = 64 (as an FP8 weight; the published
  checkpoint keeps it bf16), ``qkv_proj`` N = 9216 (attention layers): the op alone;
- ``gdn in_proj``: what a GDN layer runs, ``in_proj_qkvz`` (FP8) and ``in_proj_ba`` (bf16, ``linear``'s
  GEMV) after the norm; fused, ``in_proj_ba`` takes the normed rows the one launch returns.

Rows per case: ``two launches`` (the Triton ``rms_norm`` with the residual, then ``fp8_linear``, default
plans), ``fused default`` (``rms_norm_fp8_linear``'s default plan: one launch where ``fp8_linear``'s plan
is the one-launch kernel, else the same two launches), ``fused one-launch`` (the RMS_NORM kernel at every
M, ``config={"ONE_LAUNCH": True}``). Times are CUDA-graph replays (launch gaps removed): what a graphed
decode step pays per layer. ``max_diff_vs_two``: max |fused - two launches| of the output (bf16; an e4m3
flip of one activation can show, see packages/atom-kernels/tests/test_kernels_fp8_rms_norm.py).
``--out``: ``norm_fp8_<gpu>.json``.

``--quick``: M = 1, 2 only. ``--smoke``: CPU under ``TRITON_INTERPRET=1``, small shapes, float32, one call each timed by wall clock
(checks the plumbing and the agreement of the two paths, not a measurement); ``norm_fp8_smoke.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

K, EPS = 2048, 1e-6
SHAPES = {"in_proj_qkvz": 12288, "in_proj_ba (fp8)": 64, "qkv_proj": 9216}
BA = 64  # in_proj_ba rows of the gdn in_proj case (bf16)
MS = (1, 2, 4, 8)
SMOKE = dict(k=256, shapes={"smoke qkvz": 256, "smoke ba (fp8)": 64}, ba=64, ms=(1, 2))


def _weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    nb, kb = -(-n // 128), -(-k // 128)
    w = torch.randn(nb * 128, kb * 128, device=device) * k**-0.5
    t = w.reshape(nb, 128, kb, 128)
    s = t.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
    return (t / s[:, None, :, None]).reshape(nb * 128, kb * 128)[:n, :k].contiguous().to(
        torch.float8_e4m3fn
    ), s


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="M = 1 and 2 only")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, small shapes")
    return ap.parse_args()


def main() -> None:
    args = _args()
    out = common.out_dir(args.out)
    if args.smoke:
        from atom_kernels.ops._triton_env import interpreting

        if not interpreting():
            sys.exit("--smoke runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
        device, dtype, ceil, k, shapes, ba, ms = (torch.device("cpu"), torch.float32, None, SMOKE["k"],
                                                  SMOKE["shapes"], SMOKE["ba"], SMOKE["ms"])  # fmt: skip
        sms = 132
    else:
        device = common.require_cuda()
        dtype, ceil, k, shapes, ba = torch.bfloat16, common.ceilings(out, device), K, SHAPES, BA
        ms = MS[:2] if args.quick else MS
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    from atom_kernels.ops._device import device_name
    from atom_kernels.ops.fp8 import triton as fp8
    from atom_kernels.ops.fp8.decode_table import tuned_table
    from atom_kernels.ops.linear import triton as linear
    from atom_kernels.ops.norm import triton as norm

    def timed(fn) -> float:
        if args.smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return common.time_ms(fn, graph=True)

    def result(ms_: float, **kw) -> dict:
        if not args.smoke:
            return common.row(bench="norm_fp8", ms=ms_, ceil=ceil, **kw)
        r = common.row(bench="norm_fp8", ms=None, ceil={}, **kw)  # no ceilings: wall time of one call
        return {**r, "ms": ms_, "timing": "interpreter wall time of one call"}

    table = tuned_table(device_name(device))  # the per-shape configs the ops take by default
    torch.manual_seed(0)
    norm_w = (0.1 * torch.randn(k, device=device)).to(dtype)
    w_ba = (torch.randn(ba, k, device=device) * k**-0.5).to(dtype)
    weights = {name: _weight(n, k, device) for name, n in shapes.items()}
    cases = [(name, n, False) for name, n in shapes.items()]
    qkvz_name = next(iter(shapes))
    cases.append(("gdn in_proj", shapes[qkvz_name], True))
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=dtype)
        res = torch.randn(m, k, device=device, dtype=torch.float32)
        for name, n, with_ba in cases:
            w, s = weights[qkvz_name if with_ba else name]
            tickets = torch.zeros(-(-n // 16), dtype=torch.int32, device=device)
            nbytes = w.numel() + s.numel() * 4 + m * k * (2 + 4 + 4 + 2) + m * n * 2  # x, res, h, normed, y
            if with_ba:
                nbytes += ba * k * 2 + m * ba * 2

            def two(x=x, res=res, w=w, s=s, tickets=tickets, with_ba=with_ba):
                normed, h = norm.rms_norm(x, norm_w, EPS, res)
                y = fp8.fp8_linear(normed, w, s, tickets=tickets)
                return (y, linear.linear(normed, w_ba)) if with_ba else (y,)

            def fused(x=x, res=res, w=w, s=s, tickets=tickets, with_ba=with_ba, config=None):
                y, normed, h = fp8.rms_norm_fp8_linear(x, norm_w, EPS, w, s, residual=res, tickets=tickets,
                                                       config=config)  # fmt: skip
                return (y, linear.linear(normed, w_ba)) if with_ba else (y,)

            ref = two()
            case = f"{name} N={n} M={m}"
            rows.append(result(timed(two), case=case, impl="two launches", nbytes=nbytes,
                               plan=str(fp8.plan(m, n, k, 128, sms, None, table))))  # fmt: skip
            for impl, cfg in (("fused default", None), ("fused one-launch", {"ONE_LAUNCH": True})):
                got = fused(config=cfg)
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref))
                ms_ = timed(lambda cfg=cfg, f=fused: f(config=cfg))
                rows.append(result(ms_, case=case, impl=impl, nbytes=nbytes,
                                   plan=str(fp8.plan(m, n, k, 128, sms, cfg, table)), max_diff_vs_two=diff))  # fmt: skip
            assert not tickets.any(), "tickets not left zero"
            base = next(r for r in rows if r["case"] == case and r["impl"] == "two launches")
            best = min((r for r in rows if r["case"] == case and r["impl"] != "two launches"),
                       key=lambda r: r["ms"])  # fmt: skip
            print(f"{case}: two launches {base['ms'] * 1e3:.2f} us, best fused {best['impl']} "
                  f"{best['ms'] * 1e3:.2f} us (max diff {best['max_diff_vs_two']:.2e})", flush=True)  # fmt: skip
    tag = "smoke" if args.smoke else common.gpu_tag(device)
    common.write_json(
        out / f"norm_fp8_{tag}.json", {"env": common.environment(), "ceilings": ceil, "rows": rows}
    )
    common.print_table(rows, ["case", "impl", "ms", "frac_copy", "max_diff_vs_two"])


if __name__ == "__main__":
    main()
