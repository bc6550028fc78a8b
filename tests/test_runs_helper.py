"""tests/_runs.py without vLLM (a stand-in runner): each planned run starts once, in the order asked, as
cores free up, with its cores bound; a tensor-parallel run holds as many cores as it has ranks; a spec
builder's exception reaches the test reading that run; unplanned names are refused."""

from __future__ import annotations

import threading
import time

import pytest
from _runs import Lanes, Runs
from conftest import planned_runs


class StandIn:
    """Records each call's spec name, bound cores and the runs running at the same time."""

    def __init__(self, seconds: float = 0.2) -> None:
        self.seconds = seconds
        self.calls: list[tuple[str, str]] = []
        self.running: set[str] = set()
        self.max_together = 0
        self.lock = threading.Lock()

    def __call__(self, spec, workdir, timeout, name, env, on_start=None):
        with self.lock:
            self.calls.append((name, env["VLLM_CPU_OMP_THREADS_BIND"]))
            self.running.add(name)
            self.max_together = max(self.max_together, len(self.running))
            together = set(self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running.discard(name)
        return {"jobs": {}, "spec": spec, "together": sorted(together)}


def _runs(tmp_path, runner, cores=(0, 1)):
    runs = Runs(tmp_path, Lanes(cores), runner)
    for name in ("a", "b", "c"):
        runs.plan(name, lambda name=name: {"name": name})
    runs.plan("tp", lambda: {"name": "tp", "tensor_parallel_size": 2})
    return runs


def test_each_run_starts_once_two_at_a_time(tmp_path):
    runner = StandIn()
    runs = _runs(tmp_path, runner)
    runs.prefetch(["a", "b", "c", "a"])
    assert runs.result("c")["spec"] == {"name": "c"}
    runs.result("a"), runs.result("b"), runs.result("a")
    assert sorted(name for name, _ in runner.calls) == ["a", "b", "c"]
    assert runner.max_together == 2
    assert {bind for _, bind in runner.calls} <= {"0", "1"}


def test_a_tensor_parallel_run_holds_every_core(tmp_path):
    runner = StandIn()
    runs = _runs(tmp_path, runner)
    runs.prefetch(["a", "tp", "b"])
    assert runs.result("tp")["together"] == ["tp"]  # a and b never ran beside it
    assert dict(runner.calls)["tp"] in ("0|1", "1|0")
    runs.result("b")
    assert [name for name, _ in runner.calls].index("b") > [name for name, _ in runner.calls].index("tp")


def test_an_unprefetched_run_starts_when_read(tmp_path):
    runner = StandIn(0.0)
    runs = _runs(tmp_path, runner, cores=(3,))
    assert runs.result("b")["spec"] == {"name": "b"}
    assert runner.calls == [("b", "3")]
    with pytest.raises(KeyError, match="no engine run 'zz'"):
        runs.result("zz")


def test_a_failing_spec_builder_fails_the_reader(tmp_path):
    runs = Runs(tmp_path, Lanes([0]), StandIn(0.0))

    def broken():
        raise FileNotFoundError("no checkpoint")

    runs.plan("broken", broken)
    runs.plan("fine", lambda: {"name": "fine"})
    runs.prefetch(["broken", "fine"])
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        runs.result("broken")
    assert runs.result("fine")["spec"] == {"name": "fine"}
    with pytest.raises(ValueError, match="planned twice"):
        runs.plan("fine", lambda: {})


def test_marker_names_take_the_test_parameters():
    class Item:
        def __init__(self, params, *names):
            self.callspec = type("C", (), {"params": params})() if params is not None else None
            self.names = names

        def iter_markers(self, name):
            assert name == "vllm_runs"
            yield pytest.mark.vllm_runs(*self.names).mark

    items = [
        Item({"k": 2}, "f32_k{k}", "bf16"),
        Item(None, "bf16", "x"),
        Item({"k": 3, "t": "e"}, "k{k}_{t}"),
    ]
    assert planned_runs(items) == ["f32_k2", "bf16", "x", "k3_e"]
