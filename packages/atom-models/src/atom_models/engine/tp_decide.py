"""Token decisions under tensor parallelism: which rank decides a step's tokens, and the broadcast of them.

Every rank runs the same schedule and gets the same all-gathered logits, so greedy tokens are decided on
every rank alike. A sampled request draws from its generator, which only rank 0 advances: a decision
involving one is made on rank 0 and its tokens are broadcast (one int64 tensor of lengths and ids), and if
rank 0 fails while deciding, the other ranks are told in the same broadcast and raise instead of waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from atom_models.engine.request import Request
from atom_models.parallel import ParallelContext


class TPDecider:
    """``decide(reqs, fn, widths)``: ``fn()``'s token lists, computed where they must be (module docstring)."""

    def __init__(self, parallel: ParallelContext, device: torch.device) -> None:
        self.parallel = parallel
        self.device = device

    def rank0_decides(self, reqs: Sequence[Request]) -> bool:
        """Under tensor parallelism a decision involving a sampled request is made on rank 0 alone."""
        return self.parallel.world_size > 1 and any(not r.params.greedy for r in reqs)

    def decide(
        self, reqs: Sequence[Request], fn: Callable[[], list[list[int]]], widths: Sequence[int]
    ) -> list[list[int]]:
        """``fn()`` (token lists, ``len(out[i]) <= widths[i]``) on every rank, or on rank 0 and broadcast
        when :meth:`rank0_decides`; if rank 0's ``fn`` raises, the other ranks raise too."""
        if not self.rank0_decides(reqs):
            return fn()
        if self.parallel.rank != 0:
            return self._broadcast(None, widths)
        try:
            out = fn()
        except Exception:
            self._broadcast(None, widths, failed=True)
            raise
        return self._broadcast(out, widths)

    def _broadcast(
        self, tokens: list[list[int]] | None, widths: Sequence[int], failed: bool = False
    ) -> list[list[int]]:
        """Rank 0's token lists on every rank (``tokens``: None off rank 0): one broadcast of an int64
        ``[n, 1 + max(widths)]`` tensor of lengths and ids. ``failed`` (rank 0): lengths of -1, on which the
        other ranks raise instead of waiting for a step that never comes."""
        buf = torch.zeros(len(widths), 1 + max(widths), dtype=torch.int64)
        if failed:
            buf[:, 0] = -1
        elif tokens is not None:
            for row, t in zip(buf, tokens):
                row[0] = len(t)
                row[1 : 1 + len(t)] = torch.tensor(t, dtype=torch.int64)
        rows = self.parallel.broadcast(buf.to(self.device), src=0).tolist()
        if tokens is None and not failed and rows[0][0] < 0:
            raise RuntimeError(
                f"tensor parallel rank {self.parallel.rank}: rank 0 failed while deciding this step's "
                "tokens (its own error says why)"
            )
        return [r[1 : 1 + r[0]] for r in rows]
