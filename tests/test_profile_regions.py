"""benchmarks/profile_regions.py: self time of a worker trace's decode steps split by region."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_regions import load, regions, report  # noqa: E402


def _ev(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def _trace() -> list[dict]:
    """A prompt step, two decode steps (a custom op inside the compiled graph, an aten op in the graph, an
    aten op outside it) and a draft forward between them, on one thread; plus an event of another thread."""
    ev = [_ev("execute_context_1(64)_generation_0(0)", 0, 50, "user_annotation"), _ev("aten::mm", 10, 20)]
    for start in (100, 300):
        ev += [
            _ev("execute_context_0(0)_generation_1(1)", start, 100, "user_annotation"),
            _ev("## Call CompiledFxGraph None ##", start + 10, 60, "user_annotation"),
            _ev("aten::mm", start + 12, 8),
            _ev("vllm::atom_gdn_core", start + 30, 30),
            _ev("aten::copy_", start + 35, 5),
            _ev("aten::slice", start + 80, 4),
        ]
    ev += [
        _ev("## Call CompiledFxGraph None ##", 210, 40, "user_annotation"),  # the draft, between the steps
        _ev("vllm::atom_attention_with_output", 215, 10),
        _ev("aten::index", 260, 6, tid=2),
        _ev("ProfilerStep", 0, 1000, "other"),  # not a host op category: ignored
    ]
    return ev


def test_regions_split_decode_steps_by_outermost_op() -> None:
    r = regions(_trace())
    assert r.steps == 2
    ms = r.per_step_ms()
    # per decode step: the op 30 us (25 own + 5 of its copy), the graph 60 - 8 - 30 + 8 (its mm) = 30 us, the
    # step 100 - 60 - 4 + 4 (its slice) = 40 us; the prompt step (before the first decode step) is left out
    assert ms["vllm::atom_gdn_core"] == pytest.approx(0.030)
    assert ms["compiled graph"] == pytest.approx(0.030)
    assert ms["step"] == pytest.approx(0.040)
    # between the steps: the draft's graph (40 - 10) and its op (10), and the other thread's aten op
    assert ms["between steps / compiled graph"] == pytest.approx(0.030 / 2)
    assert ms["between steps / vllm::atom_attention_with_output"] == pytest.approx(0.010 / 2)
    assert ms["between steps"] == pytest.approx(0.006 / 2)
    assert r.op_calls[("vllm::atom_gdn_core", "aten::copy_")] == 2
    assert r.op_us[("compiled graph", "aten::mm")] == pytest.approx(16)
    assert ("step", "aten::mm") not in r.op_us  # the prompt step's mm is left out


def test_report_and_load_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "w.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    text = report(regions(load(path)), rows=5)
    assert text.startswith("2 decode steps")
    assert "vllm::atom_gdn_core" in text and "(all)" in text
    assert regions([]).steps == 0
