"""Start vLLM's OpenAI server on the bundled model and wait for it; read its ``/metrics`` (a helper of tests/,
benchmarks/ and scripts/, not shipped: tests import it as ``_server``, the others put ``tests/`` on
``sys.path`` first).

:class:`VllmServer` runs ``python -m vllm.entrypoints.openai.api_server`` with the given arguments on a free
port (:func:`atom_core.net.free_port`), in a session of its own (stopping it stops vLLM's engine and worker
processes too), with the ATOM plugin on or off (``ATOM_DISABLE_VLLM_PLUGIN``). ``start()`` polls ``/health``
(httpx) until the server answers, and raises :class:`ServerError` with the tail of its log when it exits or
does not come up in time. ``/metrics`` is parsed by ``prometheus_client.parser``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import httpx
from atom_core.net import free_port
from prometheus_client.parser import text_string_to_metric_families


class ServerError(RuntimeError):
    """The server exited during start-up or did not answer ``/health`` in time (the message has its log)."""


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text -> ``{sample name: value summed over its label sets}`` (counters appear
    under their ``_total`` sample names, e.g. ``vllm:spec_decode_num_drafts_total``)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def per_label(text: str, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` by the value of ``label`` (e.g. accepted tokens per draft ``position``)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels.get(label, "")] = float(sample.value)
    return out


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(metrics: dict[str, float]) -> dict[str, float]:
    """``{"num_drafts", "num_draft_tokens", "num_accepted_tokens"}`` from :func:`parse_metrics`'s output."""
    return {key: metrics.get(f"vllm:spec_decode_{key}_total", 0.0) for key in SPEC_COUNTERS}


class VllmServer:
    """vLLM's OpenAI server on ``model`` (``args``: further command-line arguments, e.g. ``--dtype``).

    ``log``: a file path the server's combined output goes to, or None to leave its stdout / stderr as
    pipes (``proc.stdout``, ``proc.stderr``) for the caller to read. ``env``: extra environment on top of
    ours (``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 GiB). Use as a context manager, or ``start()`` /
    ``stop()``.
    """

    def __init__(
        self,
        model: str | Path,
        args: Sequence[str] = (),
        *,
        plugin: bool = True,
        log: str | Path | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
        timeout: float = 900.0,
    ) -> None:
        self.port = free_port() if port is None else port
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = None if log is None else Path(log)
        self.timeout = timeout
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--port", str(self.port), *args]  # fmt: skip
        self.env = dict(os.environ, ATOM_DISABLE_VLLM_PLUGIN="0" if plugin else "1")
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self, on_spawn: Callable[[subprocess.Popen], None] | None = None) -> VllmServer:
        """Start the server and wait until ``/health`` answers 200. ``on_spawn(proc)`` runs right after the
        process starts (with ``log=None``: to begin reading its pipes before they fill)."""
        t0 = time.monotonic()
        out: IO[Any] | int
        if self.log_path is not None:
            out = open(self.log_path, "w")  # noqa: SIM115 - the child keeps writing after we return
            err: IO[Any] | int = subprocess.STDOUT
        else:
            out = err = subprocess.PIPE
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=err, env=self.env, start_new_session=True
            )
        finally:
            if self.log_path is not None:
                out.close()
        if on_spawn is not None:
            on_spawn(self.proc)
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.timeout:
                self.stop()
                raise ServerError(
                    f"server did not answer /health in {self.timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(1)
        self.startup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 60 s; waits for the server to exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:] if self.log_path is not None else "(output not logged to a file)"

    def healthy(self) -> bool:
        return httpx.get(f"{self.base}/health", timeout=10).status_code == 200

    def metrics_text(self) -> str:
        r = httpx.get(f"{self.base}/metrics", timeout=30)
        r.raise_for_status()
        return r.text

    def metrics(self) -> dict[str, float]:
        """:func:`parse_metrics` of the server's ``/metrics`` now."""
        return parse_metrics(self.metrics_text())

    def metric(self, name: str) -> float:
        """One sample of ``/metrics`` (summed over label sets), 0.0 when absent."""
        return self.metrics().get(name, 0.0)
