"""Scheduling of the standalone engine: admission of waiting requests and the cache memory they hold."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from atom_models.engine.cache import EngineCaches
from atom_models.engine.request import Request


@dataclass(frozen=True)
class ScheduledStep:
    """What one target forward runs: ``prefills`` (whole prompts, newly admitted) first in the flat batch,
    then ``decodes`` (every running request, sorted by ``num_spec`` so equal query lengths are contiguous:
    1 token for a plain decode, ``1 + num_spec`` for a verification)."""

    prefills: tuple[Request, ...]
    decodes: tuple[Request, ...]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """FIFO admission under the step's token budget, the free GDN slots and the free KV blocks.

    ``waiting`` holds requests not yet admitted, ``running`` the admitted ones that have not finished.
    A request gets, at admission, every KV block it can ever need (prompt, ``max_tokens`` outputs and
    ``2k + 1`` speculative positions) and one GDN state slot; both go back when it finishes.
    """

    def __init__(
        self,
        caches: EngineCaches,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_speculative_tokens: int,
    ):
        self.caches = caches
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, req: Request) -> int:
        """KV blocks for the positions ``req`` may write: prompt + outputs + ``2k + 1`` (verify + MTP)."""
        n = len(req.prompt_ids) + req.params.max_tokens + 2 * self.num_speculative_tokens + 1
        return math.ceil(n / self.caches.block_size)

    def schedule(self) -> ScheduledStep:
        """Admit what fits, then describe the step: new prompts and every running request."""
        prefills = self._admit()
        return ScheduledStep(tuple(prefills), tuple(sorted(self.running, key=lambda r: r.num_spec)))

    def _admit(self) -> list[Request]:
        budget = self.max_num_batched_tokens - sum(1 + r.num_spec for r in self.running)
        admitted: list[Request] = []
        while self.waiting:
            req = self.waiting[0]
            need = self.blocks_needed(req)
            if (
                len(self.running) + len(admitted) >= self.max_num_seqs
                or self.caches.slots.num_free == 0
                or self.caches.blocks.num_free < need
                or ((admitted or self.running) and len(req.prompt_ids) > budget)
            ):
                break
            self.waiting.popleft()
            req.blocks = self.caches.blocks.allocate(need)
            req.slot = self.caches.slots.allocate()
            budget -= len(req.prompt_ids)
            admitted.append(req)
        if not admitted and not self.running and self.waiting:
            req = self.waiting[0]
            raise RuntimeError(
                f"request {req.request_id} needs {self.blocks_needed(req)} KV blocks, the cache has "
                f"{self.caches.blocks.num_blocks}: raise num_blocks or max_model_len"
            )
        return admitted

    def finish_step(self, step: ScheduledStep) -> list[Request]:
        """After the step's tokens are emitted: admitted prompts join ``running``, finished requests leave
        it and give back their blocks and slot. Returns the finished requests."""
        finished = [r for r in (*step.prefills, *step.decodes) if r.finished]
        self.running = [r for r in self.running if not r.finished] + [
            r for r in step.prefills if not r.finished
        ]
        for req in finished:
            self.free(req)
        return finished

    def free(self, req: Request) -> None:
        self.caches.blocks.free(req.blocks)
        self.caches.slots.free(req.slot)
        req.blocks, req.slot = [], -1
