"""Run a function on ``N`` tensor-parallel ranks: one spawned process per rank with ``torch.distributed``
initialised (gloo on the CPU, NCCL with ``cuda:<rank>`` on GPUs, or gloo with every rank on a GPU shared round
robin: ``backend="gloo"``), the results returned in rank order.

``launch(fn, N, device_type=..., args=...)`` calls ``fn(parallel, device, *args)`` in every rank, where
``parallel`` is a :class:`~atom_models.parallel.TorchDistributed` over the world group and ``device`` the
rank's device. ``fn`` and ``args`` are pickled into the ranks (``fn`` must be importable: a module-level
function). The rendezvous is ``127.0.0.1`` on a free port. When a rank raises (or dies), the other ranks
are terminated and :class:`RankFailed` is raised in the caller naming the rank, with its traceback;
every process is joined before ``launch`` returns or raises.

``generate_tp`` runs the standalone engine this way: every rank builds the engine with its
``parallel`` and generates the same prompts (the CLI's ``--tensor-parallel-size``).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp
from atom_core.net import free_port

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # the default backend per device type
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankFailed(RuntimeError):
    """A tensor-parallel rank raised (``cause``: its exception type and message) or exited abnormally."""

    def __init__(self, rank: int, world_size: int, what: str, rank_traceback: str = ""):
        self.rank = rank
        self.world_size = world_size
        self.rank_traceback = rank_traceback
        text = f"tensor-parallel rank {rank} of {world_size} failed: {what}"
        if rank_traceback:
            text += f"\n--- traceback of rank {rank} ---\n{rank_traceback.rstrip()}"
        super().__init__(text)


def rank_device(rank: int, device_type: str, backend: str) -> torch.device:
    """Rank ``rank``'s device: the CPU; ``cuda:<rank>`` under NCCL (one GPU per rank); under gloo on GPUs
    ``cuda:<rank mod visible GPUs>`` (ranks may share a GPU: gloo's collectives copy through the host)."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank if backend == "nccl" else rank % torch.cuda.device_count())


def _worker(rank, world_size, port, device_type, backend, timeout_s, fn, args, results) -> None:
    import torch.distributed as dist

    from atom_models.parallel import TorchDistributed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    if device_type == "cuda":  # no NVLink multicast (NVLS) in NCCL / PyTorch, unless the caller's env says
        for var, value in NO_MULTICAST.items():
            os.environ.setdefault(var, value)
    try:
        device = rank_device(rank, device_type, backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
        out = fn(TorchDistributed(), device, *args)
        results.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent, named by rank
        try:
            exc = pickle.dumps(e)
        except Exception:  # an exception that does not pickle: its text is still sent
            exc = None
        results.put((rank, "error", (f"{type(e).__name__}: {e}", traceback.format_exc(), exc)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


# What a rank raises when another rank's failure broke a collective under it: a consequence, not the cause.
_FOLLOW_ON = re.compile(
    r"gloo|nccl|connection (reset|closed|refused)|timed out|DistBackendError|rank 0 failed", re.I
)


def _root_cause(errors: dict[int, Any], results: Any, wait_s: float = 1.0) -> tuple[int, Any]:
    """The error to report among the first one and those that arrive within ``wait_s``: the first that is
    not a follow-on error of a broken collective (``_FOLLOW_ON``), else the lowest rank's."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue_mod.Empty:
            break
        if status == "error":
            errors[rank] = payload
    for rank, payload in errors.items():
        if not _FOLLOW_ON.search(payload[0]):
            return rank, payload
    rank = min(errors)
    return rank, errors[rank]


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    device_type: str = "cpu",
    args: Sequence[Any] = (),
    timeout_s: float = 600.0,
    backend: str | None = None,
) -> list[Any]:
    """``[fn(parallel, device, *args) of rank r for r in range(world_size)]``, each run in its own process.

    ``device_type``: ``cpu`` or ``cuda``. ``backend``: the process group's, by default gloo on the CPU and
    NCCL on GPUs (rank r on ``cuda:r``; needs ``world_size`` GPUs); ``"gloo"`` on GPUs places the ranks on
    the visible GPUs round robin (several may share one; see :func:`rank_device`), for tests of the
    sharded model on fewer GPUs than ranks. Gloo's collectives cannot be captured in a CUDA graph.
    ``timeout_s``: the process group's collective timeout and the longest the caller waits for all ranks.
    """
    if device_type not in BACKENDS:
        raise ValueError(f"device_type must be one of {sorted(BACKENDS)}, got {device_type!r}")
    backend = BACKENDS[device_type] if backend is None else backend
    if backend not in ("gloo", "nccl") or (backend == "nccl" and device_type != "cuda"):
        raise ValueError(
            f"backend must be 'gloo', or 'nccl' with device_type 'cuda', got {backend!r} on {device_type}"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    visible = torch.cuda.device_count() if device_type == "cuda" else 0
    if backend == "nccl" and visible < world_size:
        raise ValueError(
            f"tensor parallel size {world_size} over NCCL needs {world_size} GPUs, {visible} visible"
        )
    if device_type == "cuda" and visible < 1:
        raise ValueError("device_type 'cuda' needs a visible GPU, none is visible")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, device_type, backend, timeout_s, fn, tuple(args), results),
            name=f"tp-rank-{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if dead:  # exited without a result (killed, os._exit, a crash in native code)
                    r = dead[0]
                    try:  # its result may still be in flight
                        rank, status, payload = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        raise RankFailed(
                            r, world_size, f"exited with code {procs[r].exitcode} without a result"
                        ) from None
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in done]
                    raise RankFailed(
                        missing[0], world_size, f"no result within {timeout_s:.0f} s (ranks {missing})"
                    ) from None
                else:
                    continue
            if status == "error":
                rank, payload = _root_cause({rank: payload}, results)
                what, tb, exc = payload
                err = RankFailed(rank, world_size, what, tb)
                cause = None
                if exc is not None:
                    try:
                        cause = pickle.loads(exc)
                    except Exception:
                        cause = None
                raise err from cause
            done[rank] = payload
    finally:
        if len(done) == world_size:
            for p in procs:
                p.join(timeout_s)
        _stop(procs)
        results.close()
    return [done[r] for r in range(world_size)]


@dataclass(frozen=True)
class TPRun:
    """One engine built on every rank (``engine_config``) and one ``LLMEngine.generate`` call on it."""

    engine_config: Any  # EngineConfig
    prompts: Sequence[Sequence[int]]
    params: Any = None  # SamplingParams, one per prompt, or None (the defaults)


def _generate_rank(parallel, device, ckpt_dir, dtype, runs, threads):
    """One rank of :func:`generate_tp`: ``[(results, seconds of generate)]`` per run."""
    from atom_models.engine.engine import LLMEngine

    torch.set_num_threads(threads)
    out = []
    for run in runs:
        eng = LLMEngine.from_pretrained(
            ckpt_dir, run.engine_config, dtype=dtype, device=device, parallel=parallel
        )
        t0 = time.perf_counter()
        results = eng.generate(run.prompts, run.params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((results, time.perf_counter() - t0))
        del eng
    return out


def generate_tp(
    ckpt_dir,
    runs: Sequence[TPRun],
    world_size: int,
    *,
    dtype: torch.dtype = torch.float32,
    device_type: str = "cpu",
    threads: int = 1,
    timeout_s: float = 600.0,
    backend: str | None = None,
) -> list[list[tuple[list, float]]]:
    """Every run of ``runs`` on ``world_size`` ranks (one process each, :func:`launch`; ``backend`` as
    there), each rank loading its shards of ``ckpt_dir``. Returns, per rank, per run,
    ``(GenerationResults, generate seconds)``."""
    return launch(
        _generate_rank,
        world_size,
        device_type=device_type,
        args=(str(ckpt_dir), dtype, list(runs), threads),
        timeout_s=timeout_s,
        backend=backend,
    )
