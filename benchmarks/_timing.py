"""Round-robin timing for the one-thread CPU benchmarks: every form of a case timed in turn, medians."""

from __future__ import annotations

import time
from collections.abc import Callable


def medians(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall milliseconds of each form (rounded to 0.1 us): one warm-up call each, then ``reps``
    rounds in which every form runs once, so the forms see the same machine state side by side."""
    for f in fns.values():
        f()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    return {k: round(sorted(v)[len(v) // 2] * 1e3, 4) for k, v in ts.items()}
