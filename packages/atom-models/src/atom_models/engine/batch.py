"""Batch building of the standalone engine: one scheduled step -> the flat batch and its metadata.

The flat batch holds the prompts first (whole, one after another), then the running requests in groups
of equal query length (plain decodes: 1 token; verifications: the pending token plus the drafts). All
metadata is built here once per step; the forwards read it unchanged.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from atom_models.engine.context import AttentionMeta, StepContext
from atom_models.engine.request import Request
from atom_models.engine.sampling import probs_from_logits
from atom_models.engine.scheduler import ScheduledStep
from atom_models.gdn_meta import GDNDecodeMeta, GDNPrefillMeta, GDNStepMeta, GDNVerifyMeta


class SeqSpan(NamedTuple):
    """One sequence of the flat batch: its tokens are rows ``[token_offset, token_offset + num_tokens)``
    at positions ``start ..``; its logits are rows ``[logit_row, logit_row + num_logit_rows)`` of the
    step's logits (a prompt: its last token only; a decode / verification: every token). A named tuple:
    a bucketed step makes one per request, and a frozen dataclass costs several times more to build."""

    request: Request
    start: int
    num_tokens: int
    is_prefill: bool
    token_offset: int
    logit_row: int

    @property
    def num_logit_rows(self) -> int:
        return 1 if self.is_prefill else self.num_tokens


@dataclass(frozen=True)
class StepBatch:
    """One target forward: ``input_ids[T]`` / ``positions[T]`` (int64, device), the cores' ``ctx``, the
    step's block tables ``[N, max_blocks]`` (row i: ``spans[i]``) and the hidden rows whose logits are
    computed, ``logit_index[R]`` (int64, device)."""

    spans: tuple[SeqSpan, ...]
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: StepContext
    tables: torch.Tensor
    logit_index: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class HostTokens:
    """What the host reads of a step's logits ``[R, V]``: ``best[r]`` the argmax id of every row (empty
    when no request is greedy) and, per sampled request id, its rows' processed probabilities (CPU)."""

    best: list[int]
    probs: dict[int, torch.Tensor]


@dataclass(frozen=True)
class DraftInput:
    """First MTP pass of one request: target hidden rows ``hidden[n, H]`` of its newly accepted positions
    ``start .. start + n - 1``, each with the next token, ``next_tokens[n]``; ``table_row`` is its row in
    the step's block tables."""

    request: Request
    start: int
    next_tokens: list[int]
    hidden: torch.Tensor
    table_row: int


def host_tokens(
    logits: torch.Tensor, spans: list[tuple[Request, int, int]], best: torch.Tensor | None = None
) -> HostTokens:
    """Read ``logits[R, V]`` for ``spans`` (request, first row, rows): argmax on the device when a request
    is greedy (``best[R]``: already computed), processed probabilities of a sampled request's rows only
    (moved to the CPU)."""
    if best is None and any(r.params.greedy for r, _, _ in spans):
        best = logits.argmax(dim=-1)
    best = [] if best is None else best.tolist()
    probs = {
        r.request_id: probs_from_logits(logits[r0 : r0 + n], r.params).cpu()
        for r, r0, n in spans
        if not r.params.greedy
    }
    return HostTokens(best, probs)


class BatchBuilder:
    """Builds :class:`StepBatch` records and attention metadata on ``device`` for caches of
    ``block_size``-token blocks."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device

    def i32(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def i64(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def block_tables(self, reqs: list[Request]) -> torch.Tensor:
        """``[N, max_blocks]`` int32 on the device: built once per step (one host-to-device copy)."""
        width = max(len(r.blocks) for r in reqs)
        rows = [r.blocks + [0] * (width - len(r.blocks)) for r in reqs]
        return torch.tensor(rows, dtype=torch.int32).to(self.device)

    def attn_meta(self, tables: torch.Tensor, positions: torch.Tensor, q_lens: list[int]) -> AttentionMeta:
        """Varlen batch: sequence i (row i of ``tables``) has ``q_lens[i]`` new tokens at ``positions`` (device
        int64, flat), the last one being its last cached token; slots are computed on the device."""
        bs, n = self.block_size, len(q_lens)
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32).to(self.device)
        row = torch.repeat_interleave(
            torch.arange(n, device=self.device), qsl.diff(), output_size=positions.shape[0]
        )
        return AttentionMeta(
            slot_mapping=tables[row, positions // bs].long() * bs + positions % bs,
            block_tables=tables,
            seq_lens=(positions[qsl[1:].long() - 1] + 1).int(),
            query_start_loc=qsl,
        )

    def decode_meta(
        self, tables: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None = None
    ) -> AttentionMeta:
        """One new token per sequence at ``positions[N]`` (device int64) over ``tables`` (no host work):
        the MTP draft steps >= 1. Rows where ``valid[N]`` (bool) is False are padding: slot -1."""
        bs, n = self.block_size, positions.shape[0]
        rows = torch.arange(n, device=positions.device)
        slots = tables[rows, positions // bs].long() * bs + positions % bs
        if valid is not None:
            slots = torch.where(valid, slots, -1)
        return AttentionMeta(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=(positions + 1).int(),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=positions.device),
        )

    def gdn_step(
        self, prefills: tuple[Request, ...], decodes: tuple[Request, ...], num_prefill_tokens: int
    ) -> GDNStepMeta:
        """The GDN pipeline's record for this step (built once, read by every GDN layer): the prompts
        first in the flat batch, then ``decodes`` (sorted by ``num_spec``) in contiguous groups of equal
        q_len: plain decodes (requests without MTP) and verifications (1 + drafts tokens each)."""
        prefill = None
        if prefills:
            cu = [0, *itertools.accumulate(len(r.prompt_ids) for r in prefills)]
            prefill = GDNPrefillMeta(
                num_seqs=len(prefills),
                num_tokens=num_prefill_tokens,
                cu_seqlens=self.i32(cu),
                state_indices=self.i32([r.slot for r in prefills]),
                has_initial_state=torch.zeros(len(prefills), dtype=torch.bool, device=self.device),
            )
        plain: list[GDNDecodeMeta] = []
        verifies: list[GDNVerifyMeta] = []
        offset = num_prefill_tokens
        for (verify, ql), grp in itertools.groupby(
            decodes, key=lambda r: (r.num_spec > 0, 1 + len(r.drafts))
        ):
            grp = list(grp)
            slots = self.i32([r.slot for r in grp])
            if verify:
                # tokens accepted in the previous step; 1 after the prefill, whose state is committed
                accepted = self.i32([max(1, r.num_accepted) for r in grp])
                verifies.append(GDNVerifyMeta(len(grp), ql, slots, accepted, token_start=offset))
            else:
                plain.append(GDNDecodeMeta(len(grp), slots, token_start=offset))
            offset += len(grp) * ql
        return GDNStepMeta(prefill=prefill, decodes=tuple(plain), verifies=tuple(verifies))

    def build(self, step: ScheduledStep) -> StepBatch:
        """The eager flat batch of ``step`` (any mix of prompts, decodes and verifications)."""
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        logit_rows: list[int] = []
        for req in step.prefills:
            n = len(req.prompt_ids)
            spans.append(SeqSpan(req, 0, n, True, len(ids), len(logit_rows)))
            logit_rows.append(len(ids) + n - 1)
            ids += req.prompt_ids
            positions += range(n)
        num_prefill_tokens = len(ids)
        for req in step.decodes:
            q = [req.last_token, *req.drafts]
            start = req.num_computed
            spans.append(SeqSpan(req, start, len(q), False, len(ids), len(logit_rows)))
            logit_rows += range(len(ids), len(ids) + len(q))
            ids += q
            positions += range(start, start + len(q))
        gdn = self.gdn_step(step.prefills, step.decodes, num_prefill_tokens)
        tables = self.block_tables([s.request for s in spans])
        pos = self.i64(positions)
        attn = self.attn_meta(tables, pos, [s.num_tokens for s in spans])
        return StepBatch(
            spans=tuple(spans),
            input_ids=self.i64(ids),
            positions=pos,
            ctx=StepContext(attn=attn, gdn=gdn),
            tables=tables,
            logit_index=self.i64(logit_rows),
        )
