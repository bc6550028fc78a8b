"""Shared harness of ``bench_gdn.py``: the GDN layer shapes, implementation lookup, the float32-reference
checks and the timed rows (:class:`Run`). The cases themselves live in ``bench_gdn.py`` (recurrent and
chunked delta rule) and ``gdn_conv.py`` (conv1d, gating); the tolerance table ``TOL`` in ``bench_gdn.py``.
Not a benchmark script itself (``run_all.sh`` runs ``bench_*.py`` only).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import common
import torch

BF16, FP32 = torch.bfloat16, torch.float32
MAX_K = 4  # speculative tokens the conv state pool is sized for


@dataclass(frozen=True)
class Shape:
    hk: int = 16
    hv: int = 32
    dk: int = 128
    dv: int = 128
    kw: int = 4
    batches: tuple[int, ...] = (1, 8, 64, 256)
    qs: tuple[int, ...] = (1, 2, 3, 4, 5)
    prefills: tuple[tuple[int, int], ...] = ((1, 4096), (16, 512))

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    @property
    def scale(self) -> float:
        return self.dk**-0.5


QWEN3_NEXT_80B = Shape()
QUICK = replace(QWEN3_NEXT_80B, batches=(1, 64, 256), qs=(1, 4))
# tiny shapes to exercise this script's plumbing on CPU (TRITON_INTERPRET=1); no timings
SMOKE = Shape(hk=2, hv=4, dk=16, dv=32, batches=(1, 3), qs=(1, 3), prefills=((1, 70), (3, 20)))


def get_impl(op: str, backend: str, device: torch.device, dtype: torch.dtype):
    from atom_kernels import registry

    try:
        return registry.resolve(op, device, dtype, backend).fn
    except registry.KernelBackendError as exc:
        print(f"[skip] {op}/{backend}: {exc}")
        return None


def fla_ops():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as exc:
        print(f"[skip] fla-core not importable: {exc}")
        return None, None
    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule


def max_err(a: torch.Tensor, e: torch.Tensor) -> float:
    return (a.double() - e.double()).abs().max().item() if a.numel() else 0.0


def close(a: torch.Tensor, e: torch.Tensor, tol: tuple[float, float]) -> bool:
    a, e = a.double(), e.double()
    return bool((((a - e).abs() <= tol[0] + tol[1] * e.abs()) & ~a.isnan()).all())


class Run:
    """One benchmark run: checks against the float32 reference (``tol``: (what, state dtype) -> (atol,
    rtol)) and timed rows, both written to ``gdn.json`` by ``bench_gdn.main``."""

    def __init__(
        self,
        out: Path,
        device: torch.device,
        shape: Shape,
        quick: bool,
        tol: dict[tuple, tuple[float, float]],
    ) -> None:
        self.out, self.device, self.shape, self.quick, self.tol = out, device, shape, quick, tol
        self.timed = device.type == "cuda"
        self.rep_ms = 50
        self.t0 = time.monotonic()
        self.deadline_s = float("inf")
        self.ceil = common.ceilings(out, device) if self.timed else {"copy_gbps": 1.0, "matmul_tflops": 1.0}
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.failed = False
        self.fla_rec, self.fla_chunk = fla_ops()

    def time(self, fn, graph: bool) -> tuple[float | None, str]:
        if not self.timed:
            return None, "not timed (cpu)"
        try:
            fn()  # compile / autotune outside the timed region
            torch.cuda.synchronize()
            if graph:
                try:
                    return common.time_ms(fn, rep_ms=self.rep_ms, graph=True), "graph"
                except Exception:  # not capturable (host syncs): time eagerly
                    torch.cuda.synchronize()
            return common.time_ms(fn, warmup_ms=10, rep_ms=self.rep_ms), "eager"
        except Exception as exc:
            traceback.print_exc()
            return None, f"error: {type(exc).__name__}: {exc}"[:200]

    def add(self, bench, case, impl, fn, nbytes, flops=0.0, graph=True, **extra):
        ms, mode = self.time(fn, graph)
        print(
            f"  {bench:12s} {case:26s} {impl:20s} {ms if ms is None else round(ms, 4)} ms ({mode})",
            flush=True,
        )
        self.rows.append(
            common.row(
                bench=bench,
                case=case,
                impl=impl,
                ms=ms,
                ceil=self.ceil,
                nbytes=nbytes,
                flops=flops,
                timing=mode,
                **extra,
            )
        )

    def check(self, what, sd, case, got, ref) -> None:
        tol = self.tol[(what, sd)]
        err = max_err(got, ref)
        ok = close(got, ref, tol)
        self.checks.append(
            {
                "what": what,
                "state_dtype": str(sd),
                "case": case,
                "max_abs_err": err,
                "atol": tol[0],
                "rtol": tol[1],
                "ok": ok,
            }
        )
        if not ok:
            self.failed = True
            print(f"[FAIL] {what} {sd} {case}: max abs err {err:.3e} > atol {tol[0]} rtol {tol[1]}")

    def guarded(self, fn, *args) -> None:
        if time.monotonic() - self.t0 > self.deadline_s:
            print(f"[deadline] skipped {fn.__name__}{args}")
            self.checks.append({"what": fn.__name__, "case": str(args), "ok": True, "skipped": "deadline"})
            return
        try:
            fn(*args)
        except Exception:
            traceback.print_exc()
            self.failed = True
            self.checks.append({"what": fn.__name__, "case": str(args), "ok": False, "error": "exception"})
        try:
            torch.cuda.empty_cache()
        except Exception:  # the context is gone (a kernel faulted): later cases will fail fast
            self.failed = True
