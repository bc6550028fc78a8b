"""The vLLM engine runs of the integration tests: planned by name, started once per session, ahead of the
tests that read them, two at a time on the 2-core CI machine.

A test module registers each configuration it needs with :meth:`Runs.plan` (a name and a function building
its :mod:`_harness` spec) when it is imported; a test names the runs it reads with the ``vllm_runs`` marker
(names may hold ``{param}`` fields of the test's parameters) and reads them with :meth:`Runs.result`. When
the first test of ``tests/`` starts, the session fixture ``vllm_prefetch`` (conftest.py) hands every run the
selected tests name, in test order, to :meth:`Runs.prefetch`: a dispatcher thread starts them one after the
other as CPU cores free up (:class:`Lanes`). A run holds as many cores as it has tensor-parallel ranks, and
vLLM binds its worker's OpenMP threads to those cores (``VLLM_CPU_OMP_THREADS_BIND``): one thread per rank,
as vLLM's default binding gives on the 2-core machine (there it reserves one core for the engine process
and runs the worker on the other), so the numerics are those of a run alone. A test reading a run waits for
it; a run no marker named starts when it is first read. Servers that tests start themselves hold cores of
the same :class:`Lanes` (``RUNS.lanes.hold``).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def ranks_of(spec: dict[str, Any]) -> int:
    """Worker processes of a run: its tensor-parallel size times its pipeline-parallel size."""
    pp = int(spec.get("llm_kwargs", {}).get("pipeline_parallel_size", 1))
    return int(spec.get("tensor_parallel_size", 1)) * pp


def default_cores() -> list[int]:
    """The first ``ATOM_VLLM_TEST_LANES`` (default 2) CPUs this process may run on."""
    n = max(1, int(os.environ.get("ATOM_VLLM_TEST_LANES", "2")))
    return sorted(os.sched_getaffinity(0))[:n]


class Lanes:
    """A pool of CPU cores; :meth:`hold` takes ``n`` of them (fewer if the pool is smaller) until released."""

    def __init__(self, cores: Iterable[int]) -> None:
        self.cores = list(cores)
        self._free = list(self.cores)
        self._cv = threading.Condition()

    def acquire(self, n: int) -> list[int]:
        n = min(n, len(self.cores))
        with self._cv:
            self._cv.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, cores: list[int]) -> None:
        with self._cv:
            self._free.extend(cores)
            self._cv.notify_all()

    @contextmanager
    def hold(self, n: int) -> Iterator[list[int]]:
        cores = self.acquire(n)
        try:
            yield cores
        finally:
            self.release(cores)

    @staticmethod
    def bind_env(cores: list[int], ranks: int = 1) -> dict[str, str]:
        """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` workers on ``cores`` (rank r on core r mod len)."""
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cores[r % len(cores)]) for r in range(ranks))}


class Runs:
    """Named engine runs (specs built lazily), each started at most once, results kept for the session."""

    def __init__(
        self, workdir: Path, lanes: Lanes, runner: Callable[..., dict[str, Any]] | None = None
    ) -> None:
        """``runner(spec, workdir, timeout, name, env, on_start=...)``: :func:`_harness.run` by default."""
        self.workdir = workdir
        self.lanes = lanes
        self.runner = runner
        self._plans: dict[str, Callable[[], dict[str, Any]]] = {}
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._procs: list[subprocess.Popen] = []

    def plan(self, name: str, build: Callable[[], dict[str, Any]]) -> str:
        """Register run ``name``: ``build()`` returns its spec (called once, when the run is started)."""
        if name in self._plans and self._plans[name] is not build:
            raise ValueError(f"engine run {name!r} planned twice")
        self._plans[name] = build
        return name

    def planned(self, name: str) -> bool:
        return name in self._plans

    def prefetch(self, names: Iterable[str]) -> None:
        """Start the runs ``names`` (those not started yet) in this order, as cores free up."""
        with self._lock:
            new = [n for n in dict.fromkeys(names) if n not in self._futures]
            for n in new:
                if n not in self._plans:
                    raise KeyError(f"no engine run {n!r} is planned")
                self._futures[n] = Future()
        if new:
            threading.Thread(target=self._dispatch, args=(new,), name="vllm-runs", daemon=True).start()

    def result(self, name: str, timeout: float | None = None) -> dict[str, Any]:
        """The result of run ``name`` (its ``error`` key set when the engine failed), waiting for it."""
        self.prefetch([name])
        return self._futures[name].result(timeout)

    def close(self) -> None:
        """Start no further runs and stop those still running (a session ending early, e.g. ``-x``)."""
        self._closed = True
        for proc in list(self._procs):
            if proc.poll() is None:
                proc.kill()

    def _dispatch(self, names: list[str]) -> None:
        for name in names:
            future = self._futures[name]
            if self._closed:
                future.cancel()
                continue
            try:
                spec = self._plans[name]()
                json.dumps(spec)  # a spec must travel as JSON
            except BaseException as exc:  # noqa: BLE001 - a missing oracle or a bad spec reaches the test
                future.set_exception(exc)
                continue
            cores = self.lanes.acquire(ranks_of(spec))
            threading.Thread(target=self._run, args=(name, spec, cores, future), daemon=True).start()

    def _run(self, name: str, spec: dict[str, Any], cores: list[int], future: Future) -> None:
        from _harness import run

        run = self.runner or run
        try:
            env = Lanes.bind_env(cores, ranks_of(spec))
            result = run(spec, str(self.workdir), 900, name, env, on_start=self._procs.append)
            future.set_result(result)
        except BaseException as exc:  # noqa: BLE001
            future.set_exception(exc)
        finally:
            self.lanes.release(cores)


RUNS = Runs(
    Path(os.environ.get("ATOM_VLLM_TEST_WORKDIR") or tempfile.mkdtemp(prefix="atom-vllm-tests-")),
    Lanes(default_cores()),
)
"""The session's runs (tests/ helpers are imported once per pytest process)."""
