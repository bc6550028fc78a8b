"""Scheduling of the standalone engine: admission of waiting requests and the cache memory they hold, and
the postprocessing of a step (accept, emit, finish)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from atom_models.engine.cache import EngineCaches
from atom_models.engine.request import Request

if TYPE_CHECKING:  # batch.py imports this module (ScheduledStep)
    from atom_models.engine.batch import SeqSpan


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
        eos_token_id: tuple[int, ...] = (),
    ):
        self.caches = caches
        self.eos_token_id = tuple(eos_token_id)
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

    # ---- postprocess: accept, emit, finish ----------------------------------------------------------
    def postprocess(
        self,
        step: ScheduledStep,
        spans: Sequence[SeqSpan],
        tokens: Sequence[list[int]],
        drafts: Sequence[list[int]] | None = None,
    ) -> tuple[int, list[Request]]:
        """Book the step's new ``tokens`` per sequence of ``spans`` (:meth:`accept`); the next ``drafts`` of
        each unfinished request when the step computed them (else none until the model runner proposes);
        then :meth:`finish_step`. Returns the tokens emitted and the finished requests."""
        emitted = 0
        for i, (sp, new) in enumerate(zip(spans, tokens)):
            emitted += self.accept(sp, new)
            req = sp.request
            if drafts is not None and not req.finished:
                req.drafts = drafts[i]
            else:
                req.drafts = []
            req.draft_probs = None
        return emitted, self.finish_step(step)

    def accept(self, sp: SeqSpan, new: list[int]) -> int:
        """Book ``sp``'s new tokens (a prompt's first token; a verification's accepted drafts and its
        corrected / bonus token): statistics, computed / accepted positions, outputs (stopping at eos or
        max_tokens). Returns the tokens emitted."""
        req = sp.request
        if sp.is_prefill:
            accepted_inputs = sp.num_tokens  # the whole prompt, then the first token
        else:
            a = len(new) - 1  # accepted drafts
            if req.drafts:
                req.stats.record(len(req.drafts), a)
            accepted_inputs = a + 1  # the pending token and the accepted drafts
        req.num_steps += 1
        req.num_computed = sp.start + accepted_inputs
        req.num_accepted = 0 if sp.is_prefill else accepted_inputs
        return self.emit(req, new)

    def emit(self, req: Request, tokens: list[int]) -> int:
        """Append ``tokens`` to ``req``'s outputs up to its stop (eos unless ignored, ``max_tokens``)."""
        eos = () if req.params.ignore_eos else self.eos_token_id
        if len(req.output_ids) + len(tokens) < req.params.max_tokens and not any(t in eos for t in tokens):
            req.output_ids += tokens  # no stop among them: all of them
            return len(tokens)
        n = 0
        for t in tokens:
            req.output_ids.append(t)
            n += 1
            if t in eos:
                req.finished, req.finish_reason = True, "stop"
                break
            if len(req.output_ids) >= req.params.max_tokens:
                req.finished, req.finish_reason = True, "length"
                break
        return n

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
