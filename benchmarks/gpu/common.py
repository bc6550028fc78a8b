"""Shared GPU benchmark harness: ceilings, timing, JSON and PNG writers.

Every benchmark script in this folder:

1. calls :func:`ceilings` (measured once per run and cached in ``<out>/ceilings.json``, so every figure
   of one run is a fraction of ceilings measured on the same machine in the same run);
2. times callables with :func:`time_ms` (CUDA events through ``triton.testing.do_bench``, median, L2
   flushed between repetitions; ``graph=True`` replays a CUDA graph to take launch gaps out);
3. builds rows with :func:`row` and writes them with :func:`write_json` and :func:`plot_rows`.

Run ``python benchmarks/gpu/common.py --out DIR`` to measure and print only the ceilings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

COPY_BYTES = 2 << 30  # 2 GiB source buffer: ~34x the H200's 60 MB L2
MATMUL_N = 8192


def out_dir(arg: str | None = None) -> Path:
    """The output folder: ``--out`` if given, else ``$OUT``, else ``benchmarks/results/local``."""
    path = Path(arg or os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results" / "local")
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu needs a CUDA (or ROCm) device; torch.cuda.is_available() is False")
    return torch.device("cuda")


def gpu_tag(device: torch.device) -> str:
    """Short lower-case name of ``device`` for result files: ``h200``, ``h100``, ..., ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    for tag in ("H200", "H100", "A100", "MI300", "MI355"):
        if tag in name:
            return tag.lower()
    return name.split()[-1].lower().replace("-", "")


def environment() -> dict[str, Any]:
    """What ran the numbers: device, driver-side versions and library versions."""
    info: dict[str, Any] = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import fla

        info["fla_core"] = getattr(fla, "__version__", "unknown")
    except ImportError:
        info["fla_core"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            hip=getattr(torch.version, "hip", None),
            cuda=torch.version.cuda,
        )
    return info


def time_ms(fn: Callable[[], Any], *, warmup_ms: int = 25, rep_ms: int = 100, graph: bool = False) -> float:
    """Median milliseconds of ``fn()`` on the current device.

    ``graph=False``: CUDA events around each call (includes the Python launch cost, as a real step pays it),
    L2 flushed between calls. ``graph=True``: a CUDA graph of ``fn`` is replayed (launch gaps removed).
    """
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def measure_copy_gbps(device: torch.device, nbytes: int = COPY_BYTES, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    if not torch.equal(dst[:4096], src[:4096]):
        raise RuntimeError("copy ceiling: destination does not match source")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


def measure_matmul_tflops(device: torch.device, n: int = MATMUL_N, reps: int = 20) -> float:
    """Dense bf16 matmul rate (torch / cuBLAS or hipBLASLt) on random data, TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        c = a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        c = a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    if not torch.isfinite(c).all():
        raise RuntimeError("matmul ceiling: non-finite result")
    del a, b, c
    torch.cuda.empty_cache()
    return 2 * n**3 / statistics.median(times) / 1e12


def ceilings(out: Path, device: torch.device | None = None) -> dict[str, float]:
    """Ceilings of this run: read ``out/ceilings.json`` if this run measured them already, else measure."""
    path = out / "ceilings.json"
    if path.exists():
        return json.loads(path.read_text())["ceilings"]
    device = device or require_cuda()
    ceil = {"copy_gbps": measure_copy_gbps(device), "matmul_tflops": measure_matmul_tflops(device)}
    write_json(path, {"env": environment(), "ceilings": ceil})
    return ceil


def bench_setup(
    doc: str, quick_help: str | None = None, flags: Sequence[tuple[str, str]] = ()
) -> tuple[argparse.Namespace, Path, torch.device, dict[str, float]]:
    """The prologue of a benchmark's ``main()``: parse ``--out`` / ``--quick`` and the script's own
    on/off ``flags`` (``(name, help)`` pairs; description: the first line of ``doc``), then the output
    folder, the CUDA device and this run's ceilings."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    for name, help_text in flags:
        ap.add_argument(name, action="store_true", help=help_text)
    args = ap.parse_args()
    out = out_dir(args.out)
    device = require_cuda()
    return args, out, device, ceilings(out, device)


def backend_ops(backend: str, device: torch.device, names: Sequence[str]) -> SimpleNamespace:
    """The ``backend`` implementations of ``names`` (bf16), resolved op by op: forcing a backend for the
    whole Kernels set would fail on ops a bench does not use (e.g. fla-backed GDN without fla-core)."""
    from atom_kernels import registry

    return SimpleNamespace(**{n: registry.resolve(n, device, torch.bfloat16, backend).fn for n in names})


def row(
    *,
    bench: str,
    case: str,
    impl: str,
    ms: float | None,
    ceil: dict[str, float],
    nbytes: float = 0.0,
    flops: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    """One result: time, achieved GB/s and TFLOP/s, and their fractions of this run's ceilings.

    ``nbytes`` is the fewest bytes the op must move (each input read once, each output written once);
    ``flops`` the arithmetic it must do. ``ms=None`` records a case that could not run (``extra`` says why).
    """
    r: dict[str, Any] = {
        "bench": bench,
        "case": case,
        "impl": impl,
        "ms": ms,
        "bytes": nbytes,
        "flops": flops,
    }
    if ms:
        sec = ms / 1e3
        r["gbps"] = nbytes / sec / 1e9
        r["tflops"] = flops / sec / 1e12
        r["frac_copy"] = r["gbps"] / ceil["copy_gbps"]
        r["frac_matmul"] = r["tflops"] / ceil["matmul_tflops"]
    r.update(extra)
    return r


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """A plain fixed-width table of ``columns`` (missing values print as '-')."""

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))
    sys.stdout.flush()


def plot_rows(
    path: Path, rows: Sequence[dict[str, Any]], *, value: str = "frac_copy", title: str = "", xlabel: str = ""
) -> None:
    """Horizontal grouped bars: one group per ``case``, one bar per ``impl``; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[plot] matplotlib missing, {path.name} not written")
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    vals = {(r["case"], r["impl"]): r.get(value) for r in rows}
    height = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(cases) * max(len(impls), 1) + 1.5))
    for j, impl in enumerate(impls):
        ys = [i + j * height for i in range(len(cases))]
        xs = [vals.get((c, impl)) or 0.0 for c in cases]
        ax.barh(ys, xs, height=height, label=impl)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))])
    ax.set_yticklabels(cases, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel or value)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output folder (default: $OUT or benchmarks/results/local)")
    args = ap.parse_args()
    out = out_dir(args.out)
    ceil = ceilings(out)
    print(json.dumps({"env": environment(), "ceilings": ceil}, indent=1))


if __name__ == "__main__":
    main()
