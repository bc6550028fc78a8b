"""GDN output at decode sizes: ``gated_norm_fp8_linear``'s one launch against ``gated_rms_norm`` + ``fp8_linear``.

Shapes of Qwen3-Next-80B-A3B's GDN output: o and the gate z ``[M, 32 heads, 128]`` (K = 4096; z a
row-strided view of the in_proj_qkvz output, as in the model), ``out_proj`` e4m3 ``[2048, 4096]`` with
128 x 128 block scales, bf16, M = 1, 2, 8 tokens. Times are CUDA-graph replays (launch gaps removed), so
they are what a graphed decode step pays per GDN layer (36 layers at 80B). Rows per M:

- ``two launches``: the Triton ``gated_rms_norm``, then ``fp8_linear`` (its default plan);
- ``fused default``: ``gated_norm_fp8_linear`` with the default plan (one launch where ``fp8_linear``'s
  plan is the one-launch kernel, M <= 2; else the same two launches);
- ``fused one-launch``: the GATED_NORM kernel at every M (``config={"ONE_LAUNCH": True}``), and without
  ``--quick`` a sweep of its column tile and split-K.

``max_diff_vs_two``: max |fused - two launches| (bf16; an e4m3 flip of one activation can show, see
tests/test_kernels_fp8_gated_norm.py). ``--out``: ``gated_norm_fp8_h200.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HV, DV, N, EPS = 32, 128, 2048, 1e-6
K = HV * DV
QKVZ = 12288  # in_proj_qkvz output width at 80B (q, k, v, z): z is its last K columns
MS = (1, 2, 8)


def _weight(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(N, K, device=device) * K**-0.5
    t = w.reshape(N // 128, 128, K // 128, 128)
    s = t.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
    return (t / s[:, None, :, None]).reshape(N, K).to(torch.float8_e4m3fn), s


def main() -> None:
    args, out, device, ceil = common.bench_setup(__doc__, "defaults only: no tile sweep")
    from atom_kernels.ops.fp8 import triton as fp8
    from atom_kernels.ops.norm import triton as norm

    w, s = _weight(device)
    norm_w = (1.0 + 0.1 * torch.randn(DV, device=device)).to(torch.bfloat16)
    rows = []
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for m in MS:
        o = torch.randn(m, HV, DV, device=device, dtype=torch.bfloat16)
        z = torch.randn(m, QKVZ, device=device, dtype=torch.bfloat16)[:, QKVZ - K :].unflatten(-1, (HV, DV))
        nbytes = N * K + s.numel() * 4 + 2 * m * K * 2 + m * N * 2  # weight, scales, o and z, y
        tickets = torch.zeros(N // 16, dtype=torch.int32, device=device)

        def two(o=o, z=z, tickets=tickets):
            return fp8.fp8_linear(norm.gated_rms_norm(o, z, norm_w, EPS).flatten(-2), w, s, tickets=tickets)

        def fused(o=o, z=z, tickets=tickets, config=None):
            return fp8.gated_norm_fp8_linear(o, z, norm_w, EPS, w, s, tickets=tickets, config=config)

        ref = two()
        configs = [("fused default", None), ("fused one-launch", {"ONE_LAUNCH": True})]
        if not args.quick:
            for block_n in (16, 32, 64):
                for split in (1, 2, 4, 8):
                    configs.append((f"fused one-launch bn{block_n} s{split}",
                                    {"ONE_LAUNCH": True, "BLOCK_N": block_n, "SPLIT_K": split}))  # fmt: skip
        case = f"M={m}"
        plan = fp8.plan(m, N, K, 128, sms)
        rows.append(common.row(bench="gated_norm_fp8", case=case, impl="two launches", ceil=ceil,
                               ms=common.time_ms(two, graph=True), nbytes=nbytes, plan=str(plan)))  # fmt: skip
        for name, cfg in configs:
            got = fused(config=cfg)
            ms = common.time_ms(lambda cfg=cfg, f=fused: f(config=cfg), graph=True)
            rows.append(common.row(bench="gated_norm_fp8", case=case, impl=name, ms=ms, ceil=ceil,
                                   nbytes=nbytes, plan=str(fp8.plan(m, N, K, 128, sms, cfg)),
                                   max_diff_vs_two=float((got.float() - ref.float()).abs().max())))  # fmt: skip
        assert not tickets.any(), "tickets not left zero"
        base = next(r for r in rows if r["case"] == case and r["impl"] == "two launches")
        best = min(
            (r for r in rows if r["case"] == case and r["impl"] != "two launches"), key=lambda r: r["ms"]
        )
        print(f"{case}: two launches {base['ms'] * 1e3:.2f} us, best fused {best['impl']} "
              f"{best['ms'] * 1e3:.2f} us (max diff {best['max_diff_vs_two']:.2e})", flush=True)  # fmt: skip
    common.write_json(
        out / "gated_norm_fp8_h200.json", {"env": common.environment(), "ceilings": ceil, "rows": rows}
    )
    common.print_table(rows, ["case", "impl", "ms", "frac_copy", "max_diff_vs_two"])


if __name__ == "__main__":
    main()
