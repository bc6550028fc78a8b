"""Where a vLLM worker's decode step goes, per region, from the trace that vLLM's torch profiler writes.

vLLM's worker profiler (``profiler_config`` with ``"profiler": "torch"``, as ``vllm_worker_profile.py`` sets
it) writes a Chrome trace (``*.pt.trace.json.gz``) beside its op table. The table sums each op over the whole
job; this splits the self time of every recorded event by the *region* it ran in:

- the outermost custom op around it (``vllm::atom_gdn_core``, ``vllm::cpu_gdn_attention_core``,
  ``_C::weight_packed_linear``, ...): the op's own Python / C code and the aten ops it calls;
- ``compiled graph``: inside a call of the compiled model (``## Call CompiledFxGraph``), outside any custom op
  (inductor's fused kernels, the extern ``mm`` calls, ...);
- ``step``: inside vLLM's ``execute_context_*`` annotation of a step, outside the compiled model (metadata
  builders, input preparation, ``compute_logits``, the Python of vLLM's model runner);
- ``between steps``: outside any step (the sampler, the MTP proposer's draft forward and its logits), each
  with the same split (``between steps / <region>``).

Only the decode part of the job counts: events from the start of the first decode step (an annotation named
``execute_context_0(0)_generation_*``: no prompt tokens) to the end of the last one; the figures are per decode
step. The profiler's own cost per recorded op lands in the self time of whatever encloses it, so a region with
many small aten ops looks slower than it runs unprofiled: compare regions of two traces, not absolute times.

    uv run --no-sync python benchmarks/profile_regions.py TRACE.pt.trace.json.gz [--rows 30]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

DECODE_STEP = "execute_context_0(0)_generation"
"""Prefix of vLLM's annotation of a step without prompt tokens (``execute_context_<prompt tokens>(...)``)."""
STEP = "execute_context_"
GRAPH = "## Call CompiledFxGraph"
OP_PREFIXES = ("vllm::", "_C::")
CATEGORIES = ("cpu_op", "user_annotation", "python_function")


@dataclass
class Regions:
    """Self time (microseconds, over the decode steps) per region and per (region, event name)."""

    steps: int = 0
    region_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    op_us: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    op_calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {r: v / n / 1000 for r, v in sorted(self.region_us.items(), key=lambda x: -x[1])}


def _region(chain: list[str]) -> str:
    """The region of an event whose enclosing events are ``chain`` (outermost first, the event last)."""
    in_step = any(n.startswith(STEP) for n in chain)
    where = "step" if in_step else "between steps"
    for name in chain:
        if name.startswith(OP_PREFIXES):
            return name if in_step else f"between steps / {name}"
    if any(n.startswith(GRAPH) for n in chain):
        return "compiled graph" if in_step else "between steps / compiled graph"
    return where


def _nested(evs: list[dict]) -> list[tuple[list[str], dict, float]]:
    """Each event of one thread with the names of the events around it (outermost first, itself last) and
    its self time (its duration less its direct children's)."""
    evs = sorted(evs, key=lambda e: (e["ts"], -e["dur"]))
    stack: list[tuple[dict, list[float]]] = []  # (event, [its children's total duration])
    names: list[str] = []
    out: list[tuple[list[str], dict, float]] = []
    for e in [*evs, None]:
        until = float("inf") if e is None else e["ts"]
        while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= until:
            ev, child = stack.pop()
            out.append((names.copy(), ev, ev["dur"] - child[0]))
            names.pop()
            if stack:
                stack[-1][1][0] += ev["dur"]
        if e is not None:
            stack.append((e, [0.0]))
            names.append(str(e["name"]))
    return out


def regions(events: Iterable[dict]) -> Regions:
    """:class:`Regions` of the decode steps in a Chrome trace's events (complete events, ``ph == "X"``)."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in CATEGORIES:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    decode = [e for evs in by_thread.values() for e in evs if str(e["name"]).startswith(DECODE_STEP)]
    out = Regions(steps=len(decode))
    if not decode:
        return out
    lo = min(e["ts"] for e in decode)
    hi = max(e["ts"] + e["dur"] for e in decode)
    for evs in by_thread.values():
        for chain, ev, self_us in _nested(evs):
            if ev["ts"] < lo or ev["ts"] + ev["dur"] > hi:
                continue  # before the first decode step or after the last
            if any(n.startswith(STEP) and not n.startswith(DECODE_STEP) for n in chain):
                continue  # a step with prompt tokens
            region = _region(chain)
            key = (region, str(ev["name"]))
            out.region_us[region] += self_us
            out.op_us[key] += self_us
            out.op_calls[key] += 1
    return out


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def report(r: Regions, rows: int = 30) -> str:
    """The regions (ms per decode step) and the top ``rows`` (region, event) self times (us per step)."""
    n = max(r.steps, 1)
    lines = [f"{r.steps} decode steps; self time per step by region:"]
    total = sum(r.region_us.values()) / n / 1000
    for name, ms in r.per_step_ms().items():
        lines.append(f"  {name:58s} {ms:8.3f} ms")
    lines.append(f"  {'(all)':58s} {total:8.3f} ms")
    lines.append("top events by self time (region | event | us per step | calls per step):")
    top = sorted(r.op_us.items(), key=lambda x: -x[1])[:rows]
    for (region, name), us in top:
        calls = r.op_calls[(region, name)] / n
        lines.append(f"  {region[:40]:40s} | {name[:48]:48s} | {us / n:9.1f} | {calls:6.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    for path in args.traces:
        print(f"== {path}\n{report(regions(load(path)), args.rows)}", flush=True)


if __name__ == "__main__":
    main()
