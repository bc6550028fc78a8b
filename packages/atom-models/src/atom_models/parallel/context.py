"""The communicator a sharded model is given: rank, world size, all-reduce and all-gather.

atom-models never creates process groups; the caller injects one of these. The standalone engine uses
:class:`TorchDistributed` (gloo on CPU, NCCL on GPUs); the vLLM plugin supplies vLLM's tensor-parallel
group; :class:`SingleProcess` is TP = 1 (both collectives are the identity, no communication).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ParallelContext(Protocol):
    """What a sharded layer needs from its tensor-parallel group.

    ``all_reduce(x)`` returns the element-wise sum of ``x`` over the ranks (same shape and dtype; the result
    may be ``x`` itself, written in place, or a new tensor: use the return value). ``all_gather(x, dim)``
    returns the ranks' tensors concatenated along ``dim`` in rank order. ``broadcast(x, src)`` returns rank
    ``src``'s ``x`` on every rank (in place). All three are collective: every rank calls them in the same
    order with tensors of the same shape.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor: ...

    @property
    def capturable(self) -> bool:
        """Whether the collectives can run inside a CUDA graph capture (NCCL's can, gloo's cannot)."""
        ...


@dataclass(frozen=True)
class SingleProcess:
    """TP = 1: rank 0 of 1; the collectives return their input unchanged."""

    rank: int = 0
    world_size: int = 1
    capturable: bool = True  # no collectives to capture

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class RankWithoutGroup:
    """Rank ``rank`` of ``world_size`` with no process group: for building a rank's shard and loading its
    slices (neither communicates) without starting the other ranks, e.g. to count a rank's bytes. Any
    collective raises ``RuntimeError``."""

    rank: int
    world_size: int
    capturable: bool = True  # nothing it runs is a collective

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"rank {self.rank} of {self.world_size} has no process group: no collectives")

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.all_reduce(x)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.all_reduce(x)


class TorchDistributed:
    """A ``torch.distributed`` process group (default: the world group, which must be initialised).

    Works with any backend that implements ``all_reduce``, ``all_gather`` (a list of per-rank tensors,
    concatenated along ``dim``) and ``broadcast`` (gloo on CPU, NCCL on CUDA).
    """

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributed: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) first (gloo on CPU, nccl on GPUs)"
            )
        self._dist = dist
        self.group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def capturable(self) -> bool:
        """False for gloo with more than one rank: its collectives copy through the host."""
        return self._world_size == 1 or self._dist.get_backend(self.group) != "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return x
        self._dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self._world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self._world_size)]
        self._dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self._world_size == 1:
            return x
        self._dist.broadcast(
            x, src=self._dist.get_global_rank(self.group, src) if self.group else src, group=self.group
        )
        return x

    def __repr__(self) -> str:
        return f"TorchDistributed(rank={self._rank}, world_size={self._world_size}, backend={self._dist.get_backend(self.group)})"


SINGLE_PROCESS = SingleProcess()  # the default ``parallel`` of every model and layer (TP = 1; immutable)
