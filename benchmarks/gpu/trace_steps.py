"""Where the time of a served engine step goes, read from a torch profiler trace (Chrome JSON, ``.gz`` too).

vLLM's worker writes such a trace when ``LLM(profiler_config={"profiler": "torch", ...})`` runs between
``start_profile()`` and ``stop_profile()``; with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1`` its model runner marks
its phases as user annotations (``gpu_model_runner: preprocess``, ``forward``, ``sample``, ``draft``,
``bookkeep``, ...). This reads:

- the step: one per ``gpu_model_runner: preprocess`` annotation (V1's runner; under Model Runner V2, one per
  ``execute_context_...`` scope); per step the wall time to the next one, the
  GPU's busy time inside it (the union of kernel, memcpy and memset intervals) and its kernel count;
- each annotation's count and mean host time;
- the GPU's idle gaps longer than ``--gap-us``, summed by the innermost annotation (and the outermost host op)
  running on the host at the gap's midpoint: what the GPU waits for.

    python benchmarks/gpu/trace_steps.py TRACE.json.gz [--skip 3] [--json OUT.json]

Prints a short table; ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_MARK = "gpu_model_runner: preprocess"
# Model Runner V2 marks each step with one ``execute_context_<n>(<tokens>)_generation_...`` scope
STEP_MARK_V2 = "execute_context_"


def load_events(path: Path) -> list[dict[str, Any]]:
    """The complete (``ph == "X"``) events of a Chrome trace file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _covering(spans: list[tuple[float, float, str]], t: float) -> str | None:
    """The innermost span (shortest) of ``spans`` that contains time ``t``."""
    best = None
    for s, e, name in spans:
        if s <= t <= e and (best is None or e - s < best[1] - best[0]):
            best = (s, e, name)
    return best[2] if best else None


def analyse(events: list[dict[str, Any]], skip: int = 0, gap_us: float = 20.0) -> dict[str, Any]:
    """Per-step wall / GPU-busy times, annotation means and GPU idle gaps by host phase (see the module doc)."""
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS]
    notes = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "user_annotation"]
    ops = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "cpu_op"]
    marks = sorted(s for s, _, n in notes if n == STEP_MARK)
    if not marks:  # Model Runner V2 has no V1 phase scopes; its step scope starts with STEP_MARK_V2
        marks = sorted(s for s, _, n in notes if n.startswith(STEP_MARK_V2))
    marks = marks[skip:]
    busy = _union(gpu)
    starts = [s for s, _ in busy]
    steps = []
    for a, b in zip(marks, marks[1:], strict=False):
        lo = bisect.bisect_left(starts, a) - 1
        t_busy = sum(max(0.0, min(e, b) - max(s, a)) for s, e in busy[max(lo, 0) :] if s < b)
        n_kernels = sum(1 for s, _ in gpu if a <= s < b)
        steps.append({"wall_us": b - a, "gpu_busy_us": t_busy, "kernels": n_kernels})
    window = (marks[0], marks[-1]) if len(marks) > 1 else (min(starts, default=0), max(starts, default=0))
    by_note: dict[str, list[float]] = defaultdict(list)
    for s, e, n in notes:
        if window[0] <= s < window[1]:
            by_note[n].append(e - s)
    # top-level host ops only: those not inside another cpu_op on the same span list
    ops.sort()
    top_ops, end = [], -1.0
    for s, e, n in ops:
        if s >= end:
            top_ops.append((s, e, n))
            end = e
    gaps_by_note: dict[str, float] = defaultdict(float)
    gaps_by_op: dict[str, float] = defaultdict(float)
    n_gaps, gap_total = 0, 0.0
    for (_, e0), (s1, _) in zip(busy, busy[1:], strict=False):
        g = s1 - e0
        if g < gap_us or not (window[0] <= e0 < window[1]):
            continue
        n_gaps, gap_total = n_gaps + 1, gap_total + g
        mid = (e0 + s1) / 2
        gaps_by_note[_covering(notes, mid) or "(no annotation)"] += g
        gaps_by_op[_covering(top_ops, mid) or "(no host op)"] += g
    n = max(len(steps), 1)
    return {
        "steps": len(steps),
        "step_wall_us_median": statistics.median(s["wall_us"] for s in steps) if steps else None,
        "step_gpu_busy_us_median": statistics.median(s["gpu_busy_us"] for s in steps) if steps else None,
        "kernels_per_step_median": statistics.median(s["kernels"] for s in steps) if steps else None,
        "annotations_mean_us": {k: {"count": len(v), "mean_us": statistics.fmean(v)} for k, v in by_note.items()},
        "gaps_over_us": gap_us,
        "gap_us_per_step": gap_total / n,
        "gaps_per_step": n_gaps / n,
        "gap_us_per_step_by_annotation": dict(sorted(((k, v / n) for k, v in gaps_by_note.items()), key=lambda x: -x[1])),
        "gap_us_per_step_by_host_op": dict(sorted(((k, v / n) for k, v in gaps_by_op.items()), key=lambda x: -x[1])[:15]),
        "per_step": steps,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--skip", type=int, default=2, help="steps to drop at the start of the trace")
    ap.add_argument("--gap-us", type=float, default=20.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    r = analyse(load_events(args.trace), skip=args.skip, gap_us=args.gap_us)
    print(f"{r['steps']} steps: wall {r['step_wall_us_median']} us, GPU busy {r['step_gpu_busy_us_median']} us, "
          f"{r['kernels_per_step_median']} kernels (medians); GPU idle in gaps > {args.gap_us} us: "
          f"{r['gap_us_per_step']:.0f} us/step in {r['gaps_per_step']:.1f} gaps")  # fmt: skip
    for name, v in sorted(r["annotations_mean_us"].items(), key=lambda x: -x[1]["mean_us"] * x[1]["count"]):
        print(f"  {name:50s} {v['count']:6d} x {v['mean_us']:9.1f} us")
    print("GPU idle per step by host annotation:")
    for name, v in r["gap_us_per_step_by_annotation"].items():
        print(f"  {name:50s} {v:9.1f} us")
    print("GPU idle per step by top-level host op:")
    for name, v in r["gap_us_per_step_by_host_op"].items():
        print(f"  {name[:50]:50s} {v:9.1f} us")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
