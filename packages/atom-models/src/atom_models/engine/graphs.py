"""Bucketed decode / verify steps over persistent buffers, replayed from CUDA graphs.

A step without prompts whose running requests all hold the same number of drafts ``s`` (query length
``q = 1 + s``) runs here: its ``n`` sequences are padded to the next batch-size bucket ``b`` and its
metadata is copied into buffers sized for the largest bucket. Two forwards per bucket:

- target (key ``(q, b)``): ``b * q`` tokens -> hidden ``[b*q, H]``, float32 logits ``[b*q, V]`` and their
  argmax ``[b*q]``; GDN as plain decodes (``q == 1``) or verifications;
- MTP propose (key ``(s, b)``, greedy requests only): the first MTP pass over all ``q`` rows of every
  sequence (row ``j`` takes the target hidden at position ``start + j`` and the next token; rows past
  the accepted ones take token 0 and only write MTP KV that later steps overwrite before reading), then
  ``s - 1`` single-row steps from each sequence's last accepted row -> draft ids ``[b, s]``.

Padding rows use GDN slot -1 and KV slot -1 (nothing read from or written to any real slot), block
table row 0s and ``seq_len = q``; their outputs are ignored. With ``capture`` (CUDA) each forward is
captured once per key, the first time it is needed, after one warm-up over padding only, in one memory
pool shared by all graphs; a graph's outputs are read before any other graph is replayed. Without
``capture`` the same forwards run eagerly over the same buffers (the bucketing and padding on any device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atom_models.engine.batch import BatchBuilder, SeqSpan
from atom_models.engine.context import AttentionMeta, StepContext
from atom_models.engine.request import Request
from atom_models.engine.scheduler import ScheduledStep
from atom_models.gdn_meta import GDNDecodeMeta, GDNStepMeta, GDNVerifyMeta


def bucket_sizes(max_batch: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then multiples of 16, and ``max_batch`` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes) | {max_batch})


@dataclass(frozen=True)
class TargetOutputs:
    """Outputs of a bucketed target forward over ``b * q`` rows (padding rows included)."""

    hidden: torch.Tensor  # [b*q, H] post-norm hidden states
    logits: torch.Tensor  # [b*q, V] float32
    best: torch.Tensor  # [b*q] int64 argmax of logits


@dataclass
class _Entry:
    body: Callable[[], Any]
    graph: Any = None  # torch.cuda.CUDAGraph when captured
    out: Any = None  # the captured outputs (static tensors)

    def __call__(self):
        if self.graph is None:
            return self.body()
        self.graph.replay()
        return self.out


class DecodeGraphs:
    """Buffers, buckets and (captured) forwards for uniform decode / verify steps of ``target`` and
    ``mtp`` (None without speculative decoding); ``max_blocks`` block-table columns per sequence."""

    def __init__(
        self,
        target,
        mtp,
        builder: BatchBuilder,
        *,
        max_batch: int,
        num_speculative_tokens: int,
        max_blocks: int,
        device: torch.device,
        capture: bool,
    ):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.target, self.mtp, self.builder = target, mtp, builder
        self.buckets = bucket_sizes(max_batch)
        self.device, self.capture = device, capture
        bmax, qmax = self.buckets[-1], 1 + num_speculative_tokens
        tmax = bmax * qmax
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(tmax, **i64)
        self.positions = torch.zeros(tmax, **i64)
        self.slot_mapping = torch.full((tmax,), -1, **i64)
        self.tables = torch.zeros(bmax, max_blocks, **i32)
        self.seq_lens = torch.ones(bmax, **i32)
        self.gdn_slots = torch.full((bmax,), -1, **i32)
        self.num_accepted = torch.ones(bmax, **i32)
        self.draft_input_ids = torch.zeros(tmax, **i64)
        self.last_rows = torch.zeros(bmax, **i64)
        self._host_tables = torch.zeros(bmax, max_blocks, dtype=torch.int32)  # staging for self.tables
        self._row_owner: list[Request | None] = [None] * bmax  # the request whose blocks a row holds
        self._targets: dict[tuple[int, int], _Entry] = {}
        self._proposers: dict[tuple[int, int], _Entry] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._last_target: TargetOutputs | None = None
        self.target_runs = 0  # bucketed target forwards run (replayed when captured)
        self.propose_runs = 0  # bucketed MTP propose forwards run

    @property
    def num_captured(self) -> int:
        """CUDA graphs captured so far (0 without ``capture``)."""
        entries = [*self._targets.values(), *self._proposers.values()]
        return sum(e.graph is not None for e in entries)

    # ---- eligibility -------------------------------------------------------------------------------
    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def supports(self, step: ScheduledStep) -> bool:
        """No prompts, at most the largest bucket of sequences, all with the same number of drafts."""
        d = step.decodes
        return (
            not step.prefills
            and 0 < len(d) <= self.buckets[-1]
            and len({r.num_spec for r in d}) == 1
            and all(len(r.drafts) == r.num_spec for r in d)
        )

    def can_propose(self, decodes: tuple[Request, ...]) -> bool:
        """The MTP propose forward serves greedy requests with drafts (sampled drafts need the host)."""
        return self.mtp is not None and decodes[0].num_spec > 0 and all(r.params.greedy for r in decodes)

    # ---- target --------------------------------------------------------------------------------------
    def run_target(self, decodes: tuple[Request, ...]) -> tuple[TargetOutputs, tuple[SeqSpan, ...]]:
        """Fill the buffers from ``decodes`` (padded to their bucket), run (replay) the target forward.
        Returns its outputs (``b * q`` rows, sequence i at rows ``i*q ..``) and the sequences' spans."""
        n, q = len(decodes), 1 + decodes[0].num_spec
        b = self.bucket(n)
        key = (q, b)
        if key not in self._targets:
            self._capture_bucket(q, b)
        bs = self.builder.block_size
        ids, pos, slots = [0] * (b * q), list(range(q)) * b, [-1] * (b * q)
        seq_lens, gdn_slots, accepted = [q] * b, [-1] * b, [1] * b
        spans = []
        for i, req in enumerate(decodes):
            start, r0 = req.num_computed, i * q
            ids[r0 : r0 + q] = [req.last_token, *req.drafts]
            for j in range(q):
                p = start + j
                pos[r0 + j] = p
                slots[r0 + j] = req.blocks[p // bs] * bs + p % bs
            self._host_table_row(i, req)
            seq_lens[i], gdn_slots[i], accepted[i] = start + q, req.slot, max(1, req.num_accepted)
            spans.append(SeqSpan(req, start, q, False, r0, r0))
        for i in range(len(decodes), b):
            self._host_table_row(i, None)
        t = b * q
        self.input_ids[:t].copy_(torch.tensor(ids))
        self.positions[:t].copy_(torch.tensor(pos))
        self.slot_mapping[:t].copy_(torch.tensor(slots))
        self.tables[:b].copy_(self._host_tables[:b])
        self.seq_lens[:b].copy_(torch.tensor(seq_lens))
        self.gdn_slots[:b].copy_(torch.tensor(gdn_slots))
        self.num_accepted[:b].copy_(torch.tensor(accepted))
        self._last_target = self._targets[key]()
        self.target_runs += 1
        return self._last_target, tuple(spans)

    def _host_table_row(self, i: int, req: Request | None) -> None:
        """Row ``i`` of the host block tables holds ``req``'s blocks (zeros for padding); a request's
        blocks are fixed from admission on, so a row is rewritten only when its request changes."""
        if self._row_owner[i] is req:
            return
        row = self._host_tables[i]
        row.zero_()
        if req is not None:
            row[: len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
        self._row_owner[i] = req

    def _attn(self, q: int, b: int) -> AttentionMeta:
        t = b * q
        return AttentionMeta(
            slot_mapping=self.slot_mapping[:t],
            block_tables=self.tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=torch.arange(0, t + 1, q, dtype=torch.int32, device=self.device),
        )

    def _target_forward(self, q: int, b: int) -> TargetOutputs:
        t = b * q
        slots = self.gdn_slots[:b]
        if q == 1:
            gdn = GDNStepMeta(decodes=(GDNDecodeMeta(b, slots),))
        else:
            gdn = GDNStepMeta(verifies=(GDNVerifyMeta(b, q, slots, self.num_accepted[:b]),))
        ctx = StepContext(attn=self._attn(q, b), gdn=gdn)
        hidden = self.target(self.input_ids[:t], self.positions[:t], ctx)
        logits = self.target.compute_logits(hidden, torch.float32)
        return TargetOutputs(hidden, logits, logits.argmax(dim=-1))

    # ---- MTP propose ---------------------------------------------------------------------------------
    def run_propose(self, spans: tuple[SeqSpan, ...]) -> list[list[int]]:
        """Draft ids (``s`` per sequence) after the target forward of the same bucket has run and every
        span's request has its accepted tokens (``num_computed``) and outputs appended."""
        reqs = [sp.request for sp in spans]
        n, s = len(reqs), reqs[0].num_spec
        q, b = 1 + s, self.bucket(n)
        ids, last = [0] * (b * q), [i * q for i in range(b)]
        for i, sp in enumerate(spans):
            req, r0 = sp.request, i * q
            accepted = req.num_computed - sp.start
            nxt = req.token_slice(sp.start + 1, sp.start + 1 + accepted)
            ids[r0 : r0 + len(nxt)] = nxt
            last[i] = r0 + accepted - 1
        self.draft_input_ids[: b * q].copy_(torch.tensor(ids))
        self.last_rows[:b].copy_(torch.tensor(last))
        drafts = self._proposers[(s, b)]()
        self.propose_runs += 1
        return drafts[:n].tolist()

    def _propose_forward(self, s: int, b: int, hidden: torch.Tensor | None) -> torch.Tensor:
        """``hidden``: the captured target graph's static output, or None (eager: the outputs of the
        target forward that has just run)."""
        q = 1 + s
        t = b * q
        if hidden is None:
            hidden = self._last_target.hidden
        mtp = self.mtp
        out = mtp(self.draft_input_ids[:t], self.positions[:t], hidden, StepContext(attn=self._attn(q, b)))
        last = self.last_rows[:b]
        h, pos = out[last], self.positions[:t][last]
        tables, valid = self.tables[:b], self.gdn_slots[:b] >= 0
        d = mtp.compute_logits(h, torch.float32).argmax(dim=-1)
        drafts = [d]
        for step in range(1, s):
            pos = pos + 1
            ctx = StepContext(attn=self.builder.decode_meta(tables, pos, valid))
            h = mtp(d, pos, h, ctx, spec_step=step)
            d = mtp.compute_logits(h, torch.float32).argmax(dim=-1)
            drafts.append(d)
        return torch.stack(drafts, dim=1)

    # ---- buffers and capture -------------------------------------------------------------------------
    def _pad(self, b: int, q: int) -> None:
        """Every row of bucket ``b`` a padding row (what warm-up and capture run over)."""
        t = b * q
        self.input_ids[:t].zero_()
        self.positions[:t].copy_(torch.arange(q, device=self.device).repeat(b))
        self.slot_mapping[:t].fill_(-1)
        self.tables[:b].zero_()
        self.seq_lens[:b].fill_(q)
        self.gdn_slots[:b].fill_(-1)
        self.num_accepted[:b].fill_(1)
        self.draft_input_ids[:t].zero_()
        self.last_rows[:b].copy_(torch.arange(0, t, q, device=self.device))

    def _capture_bucket(self, q: int, b: int) -> None:
        """The target forward of key ``(q, b)`` and, with drafts (``q > 1``), the MTP propose forward of
        ``(q - 1, b)``, captured over padding rows before the step's data fills the buffers."""
        self._pad(b, q)
        target = self._capture(lambda: self._target_forward(q, b))
        self._targets[(q, b)] = target
        if self.mtp is not None and q > 1:
            hidden = None
            if target.graph is not None:
                hidden = target.out.hidden
                hidden.zero_()  # the warm-up reads it: finite values, not whatever the pool held
            self._proposers[(q - 1, b)] = self._capture(lambda: self._propose_forward(q - 1, b, hidden))

    def _capture(self, body: Callable[[], Any]) -> _Entry:
        if not self.capture:
            return _Entry(body)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            body()  # warm-up over padding rows: compiles the kernels, writes no real slot
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = body()
        return _Entry(body, graph, out)
