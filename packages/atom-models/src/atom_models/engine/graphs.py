"""Bucketed decode / verify steps over persistent buffers, replayed from CUDA graphs.

A step without prompts whose running requests all hold the same number of drafts ``s`` (query length
``q = 1 + s``) runs here: its ``n`` sequences are padded to the next batch-size bucket ``b`` and its
metadata is copied into buffers sized for the largest bucket. Two forwards per bucket:

- target (key ``(q, b)``): ``b * q`` tokens -> hidden ``[b*q, H]``, float32 logits ``[b*q, V]`` and their
  argmax ``[b*q]``; GDN as plain decodes (``q == 1``) or verifications;
- greedy acceptance + MTP propose (key ``(s, b)``, greedy requests only): per sequence the number of
  leading drafts equal to the target argmax ``a`` (:func:`~atom_models.engine.sampling.verify_greedy_rows`)
  and its emitted tokens (the argmax of its rows ``0 .. a``); then the first MTP pass over all ``q`` rows of
  every sequence (row ``j`` takes the target hidden at position ``start + j`` and the next token, the
  argmax of row ``j``, for ``j <= a``; rows past the accepted ones take token 0 and only write MTP KV that
  later steps overwrite before reading; padding rows take token 0 and read their row 0), then ``s - 1``
  single-row steps from each sequence's last accepted row ``a`` -> draft ids ``[b, s]`` (the MTP forwards
  of :class:`~atom_models.engine.proposer.MTPProposer`, as in the eager step, choosing the argmax on the
  device). Its output packs
  ``[a, tokens[q], drafts[s]]`` per sequence in one int64 ``[b, 1 + q + s]`` tensor, read by the host with
  one copy (:class:`~atom_models.engine.step_buffers.ResultReader`), so a greedy step has one host round
  trip. For a request that finishes inside its emitted tokens (eos, max_tokens) the MTP inputs past the
  stop differ from the request's tokens: its drafts are dropped.

The step's metadata reaches the device with one copy (:class:`~atom_models.engine.step_buffers.StepMetadata`),
or with none: the acceptance + propose forward ends by writing the next step's metadata over the step's own
(:meth:`DecodeGraphs._advance`: each sequence's corrected / bonus token and new drafts at the positions after
its accepted ones, their KV slots through its block table, ``seq_len`` and ``num_accepted``), so when the
next step holds the same requests in the same rows (none finished, none admitted) the host only checks that
their blocks cover the new positions and replays (``advanced_steps`` counts those steps).

Padding rows use GDN slot -1 and KV slot -1 (nothing read from or written to any real slot), block
table row 0s and ``seq_len = q``; their outputs are ignored. With ``capture`` (CUDA) each forward is
captured once per key, the first time it is needed, after one warm-up over padding only, in one memory
pool shared by all graphs; a graph's outputs are read before any other graph is replayed. Without
``capture`` the same forwards run eagerly over the same buffers (the bucketing and padding on any device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from atom_models.engine.batch import BatchBuilder, SeqSpan
from atom_models.engine.context import AttentionMeta, StepContext
from atom_models.engine.proposer import MTPProposer
from atom_models.engine.request import Request
from atom_models.engine.sampling import verify_greedy_rows
from atom_models.engine.scheduler import ScheduledStep
from atom_models.engine.step_buffers import ResultReader, StepMetadata
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


class GreedyResult(NamedTuple):
    """The host's copy of one sequence's greedy acceptance and next drafts (:meth:`DecodeGraphs.run_greedy`;
    a named tuple: one per request and step)."""

    accepted: int  # drafts accepted
    tokens: list[int]  # the emitted tokens: the accepted drafts, then the corrected / bonus token
    drafts: list[int]  # the next step's drafts


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
        self.proposer = MTPProposer(mtp, builder) if mtp is not None else None
        self.buckets = bucket_sizes(max_batch)
        self.device, self.capture = device, capture
        bmax, qmax = self.buckets[-1], 1 + num_speculative_tokens
        tmax = bmax * qmax
        self.meta = StepMetadata(
            max_tokens=tmax,
            max_batch=bmax,
            max_blocks=max_blocks,
            block_size=builder.block_size,
            device=device,
        )
        m = self.meta  # device views of one allocation, one copy per step
        self.input_ids, self.positions, self.slot_mapping = m.input_ids, m.positions, m.slot_mapping
        self.tables, self.seq_lens = m.tables, m.seq_lens
        self.gdn_slots, self.num_accepted = m.gdn_slots, m.num_accepted
        self.draft_input_ids = torch.zeros(tmax, dtype=torch.int64, device=device)  # written on the device
        self.last_rows = torch.zeros(bmax, dtype=torch.int64, device=device)
        self.reader = ResultReader(bmax * (2 * qmax), device)
        self._targets: dict[tuple[int, int], _Entry] = {}
        self._proposers: dict[tuple[int, int], _Entry] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._last_target: TargetOutputs | None = None
        self.target_runs = 0  # bucketed target forwards run (replayed when captured)
        self.propose_runs = 0  # bucketed MTP propose forwards run
        self.advanced_steps = 0  # target forwards run over metadata the previous step wrote on the device
        # the last propose forward's (requests, bucket, q, each request's next position): the device holds
        # their next step's metadata
        self._continuing: tuple[tuple[Request, ...], int, int, tuple[int, ...]] | None = None

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
        """Fill the buffers from ``decodes`` (padded to their bucket; one host-to-device copy), run (replay)
        the target forward. Returns its outputs (``b * q`` rows, sequence i at rows ``i*q ..``) and the
        sequences' spans."""
        n, q = len(decodes), 1 + decodes[0].num_spec
        b = self.bucket(n)
        key = (q, b)
        if key not in self._targets:
            self._capture_bucket(q, b)  # over padding rows: whatever the buffers held is gone
            self._continuing = None
        if self._continues(decodes, b, q):
            self.meta.check_blocks(decodes, q)
            self.advanced_steps += 1
        else:
            self.meta.fill(decodes, b, q)
        self._continuing = None
        spans = tuple(SeqSpan(req, req.num_computed, q, False, i * q, i * q) for i, req in enumerate(decodes))
        self._last_target = self._targets[key]()
        self.target_runs += 1
        return self._last_target, spans

    def _continues(self, decodes: tuple[Request, ...], b: int, q: int) -> bool:
        """Whether ``decodes`` are the requests of the last propose forward, in its rows and bucket: then
        the device holds their metadata for this step (:meth:`_advance`), as the host booked their tokens."""
        c = self._continuing
        return (
            c is not None
            and c[1:3] == (b, q)
            and len(c[0]) == len(decodes)
            and all(x is y and x.num_computed == p for x, y, p in zip(c[0], decodes, c[3]))
        )

    def forget(self) -> None:
        """The device's next-step metadata no longer describes the requests (a step ran elsewhere)."""
        self._continuing = None

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
    def run_greedy(self, spans: tuple[SeqSpan, ...]) -> list[GreedyResult]:
        """After :meth:`run_target` of the same step (greedy requests with drafts): run (replay) the
        acceptance + propose forward, read its packed results with one copy and one synchronisation."""
        n, s = len(spans), spans[0].request.num_spec
        q = 1 + s
        b = self.bucket(n)
        packed = self._proposers[(s, b)]()
        self.propose_runs += 1
        rows = self.reader.read(packed[:n])
        nxt = tuple(sp.start + r[0] + 1 for sp, r in zip(spans, rows))  # where _advance put each sequence
        self._continuing = (tuple(sp.request for sp in spans), b, q, nxt)
        return [GreedyResult(r[0], r[1 : 2 + r[0]], r[1 + q :]) for r in rows]

    def _propose_forward(self, s: int, b: int, target: TargetOutputs | None) -> torch.Tensor:
        """Greedy acceptance, MTP inputs, MTP propose -> packed ``[b, 1 + q + s]`` int64 (module
        docstring). ``target``: the captured target graph's static outputs, or None (eager: the outputs of
        the target forward that has just run)."""
        q = 1 + s
        t = b * q
        if target is None:
            target = self._last_target
        accepted, tokens = verify_greedy_rows(target.best[:t], self.input_ids[:t], q)
        valid = self.gdn_slots[:b] >= 0  # padding rows: nothing accepted, token 0, last row = row 0
        accepted = torch.where(valid, accepted, 0)
        cols = torch.arange(q, device=self.device)
        keep = cols[None, :] <= accepted[:, None]
        self.draft_input_ids[:t].copy_(torch.where(keep & valid[:, None], tokens, 0).view(-1))
        self.last_rows[:b].copy_(torch.arange(0, t, q, device=self.device) + accepted)
        h, pos = self.proposer.first_pass(
            self.draft_input_ids[:t], self.positions[:t], target.hidden, self._attn(q, b), self.last_rows[:b]
        )
        drafts: list[torch.Tensor] = []

        def choose(step: int, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
            drafts.append(logits.argmax(dim=-1))  # greedy, on the device: every row goes on
            return drafts[-1], None

        self.proposer.draft(h, pos, self.tables[:b], s, choose, valid)
        new_drafts = torch.stack(drafts, dim=1)
        self._advance(accepted, tokens, new_drafts, valid, b, q)
        return torch.cat([accepted[:, None], tokens, new_drafts], dim=1)

    def _advance(self, accepted, tokens, drafts, valid, b: int, q: int) -> None:
        """The next step's metadata of rows ``0 .. b - 1``, written over this step's after its last read: a
        valid sequence continues at ``positions + accepted + 1`` with its corrected / bonus token
        ``tokens[i, accepted[i]]`` and its new ``drafts``, KV slots through its block table row (columns
        clamped to the table: :meth:`~atom_models.engine.step_buffers.StepMetadata.check_blocks` rejects a
        request whose blocks do not cover the positions before they are used), ``seq_len + accepted + 1``
        and ``num_accepted = accepted + 1``; padding rows keep theirs. What :meth:`StepMetadata.fill` writes
        for the requests once the host has booked the step."""
        t, bs = b * q, self.builder.block_size
        v = valid[:, None]
        a1 = accepted + 1
        a1_32 = a1.to(self.seq_lens.dtype)
        ids = torch.cat([tokens.gather(1, accepted[:, None]), drafts], dim=1)
        old_pos = self.positions[:t].view(b, q)
        pos = old_pos + a1[:, None]
        col = torch.clamp(pos // bs, max=self.tables.shape[1] - 1)
        slots = self.tables[:b].gather(1, col) * bs + pos % bs
        for buf, new in ((self.input_ids, ids), (self.slot_mapping, slots), (self.positions, pos)):
            out = buf[:t].view(b, q)  # elementwise in place: each element reads only itself
            torch.where(v, new, out, out=out)
        seq, acc = self.seq_lens[:b], self.num_accepted[:b]
        torch.where(valid, seq + a1_32, seq, out=seq)
        torch.where(valid, a1_32, acc, out=acc)

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
            out = None
            if target.graph is not None:
                out = target.out
                out.hidden.zero_()  # the warm-up reads them: finite values, not whatever the pool held
                out.best.zero_()
            self._proposers[(q - 1, b)] = self._capture(lambda: self._propose_forward(q - 1, b, out))

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
