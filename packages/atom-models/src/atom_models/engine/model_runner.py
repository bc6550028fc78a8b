"""The standalone engine's model runner: builds the models, runs a scheduled step's forwards, decides its
tokens and drafts the next ones.

Build: target and (k > 0) MTP draft on the meta device, an FP8 checkpoint's quantised modules converted to
FP8 there, then allocated once on the engine's device (:func:`materialize`); the loader fills them.

Run (:meth:`ModelRunner.run`): ONE target forward over the step's flat batch (``batch``). Steps without
prompts whose requests hold equal numbers of drafts run padded to a batch-size bucket over persistent
buffers, replayed from CUDA graphs on a GPU (``graphs``). When those requests are all greedy with drafts,
the greedy acceptance and the next drafts are computed on the device too and read with one copy (one host
round trip per step). Otherwise the host decides each sequence's tokens from the logits (a prompt's first
token; a verification's accepted drafts and its corrected / bonus token; :mod:`~atom_models.engine.tp_decide`
under tensor parallelism), and after the scheduler has booked them, :meth:`ModelRunner.propose` runs the
MTP draft eagerly (:class:`~atom_models.engine.proposer.MTPProposer`, the proposer of the graphed path too)
for every unfinished request with drafts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig
from torch import nn

from atom_models.engine.batch import BatchBuilder, DraftInput, HostTokens, SeqSpan, host_tokens
from atom_models.engine.cache import EngineCaches
from atom_models.engine.cores import EngineCoreFactory
from atom_models.engine.graphs import DecodeGraphs
from atom_models.engine.proposer import MTPProposer
from atom_models.engine.request import Request
from atom_models.engine.sampling import sample, verify_greedy, verify_probs
from atom_models.engine.scheduler import ScheduledStep
from atom_models.engine.tp_decide import TPDecider
from atom_models.loader import convert_mtp_fp8, convert_target_fp8
from atom_models.parallel import ParallelContext
from atom_models.qwen3_next import Qwen3NextForCausalLM
from atom_models.qwen3_next_mtp import Qwen3NextMTP


def materialize(modules: Sequence[nn.Module | None], device: torch.device) -> None:
    """Allocate every meta-device parameter and buffer of ``modules`` on ``device``: parameters
    uninitialised (the loader writes every one), buffers zeroed (runtime state such as
    :class:`~atom_models.modules.Fp8Linear`'s split-K counters, which must start at zero).

    A tensor held by several modules (the MTP draft holds the target's ``embed_tokens`` and ``lm_head``;
    tied embeddings make ``lm_head.weight`` the embedding's) becomes ONE tensor held by all of them.
    """
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, its allocation)

    def allocate(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(torch.empty_like(t, device=device), requires_grad=t.requires_grad)
            else:
                new = torch.zeros_like(t, device=device)
            done[id(t)] = (t, new)
        return done[id(t)][1]

    for root in modules:
        if root is None:
            continue
        for mod in root.modules():
            for store in (mod._parameters, mod._buffers):
                for name, t in store.items():
                    if t is not None and t.is_meta:
                        store[name] = allocate(t)


@dataclass(frozen=True)
class StepOutput:
    """What :meth:`ModelRunner.run` returns for the scheduler to book: per sequence of ``spans`` its new
    ``tokens`` and, on the graphed greedy path, its next ``drafts`` (None: :meth:`ModelRunner.propose`
    drafts after booking, from the step's target ``hidden`` rows and block ``tables``)."""

    spans: tuple[SeqSpan, ...]
    tokens: list[list[int]]
    drafts: list[list[int]] | None
    hidden: torch.Tensor | None
    tables: torch.Tensor | None


class ModelRunner:
    """Target, MTP draft, batch builder, bucketed steps (CUDA graphs) and the token decisions of one rank."""

    def __init__(
        self,
        config: Qwen3NextConfig,
        caches: EngineCaches,
        kernels,
        *,
        num_speculative_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        cuda_graphs: bool | None,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext,
        dequantize_fp8: bool,
        expert_parallel: bool = False,
    ):
        k = num_speculative_tokens
        self.config, self.caches, self.kernels = config, caches, kernels
        self.dtype, self.device, self.parallel = dtype, device, parallel
        self.expert_parallel = expert_parallel
        self.target, self.mtp = self._build_models(k, dequantize_fp8)
        self.builder = BatchBuilder(block_size, device)
        self.decider = TPDecider(parallel, device)
        use_graphs = cuda_graphs if cuda_graphs is not None else device.type == "cuda"
        self.graphs = (
            DecodeGraphs(
                self.target,
                self.mtp,
                self.builder,
                max_batch=max_num_seqs,
                num_speculative_tokens=k,
                max_blocks=math.ceil((max_model_len + 2 * k + 1) / block_size),
                device=device,
                # gloo's collectives (ranks sharing a GPU) cannot be captured: the same forwards run eagerly
                capture=device.type == "cuda" and parallel.capturable,
            )
            if use_graphs
            else None
        )

    @property
    def proposer(self) -> MTPProposer:
        """The eager path's MTP proposer (over the current ``mtp``)."""
        return MTPProposer(self.mtp, self.builder)

    def _build_models(self, k: int, dequantize_fp8: bool):
        """Target and (k > 0) MTP draft built on the meta device, FP8 modules converted, then allocated on
        the device (uninitialised: the loader or the caller fills them)."""
        config, kernels, dtype, parallel = self.config, self.kernels, self.dtype, self.parallel
        cores = EngineCoreFactory(self.caches, kernels)
        with torch.device("meta"):
            ep = self.expert_parallel
            target = Qwen3NextForCausalLM(
                config, cores, kernels, dtype=dtype, parallel=parallel, expert_parallel=ep
            )
            shared = (target.model.embed_tokens, target.lm_head)
            mtp = (
                Qwen3NextMTP(
                    config, cores, kernels, *shared, dtype=dtype, parallel=parallel, expert_parallel=ep
                )
                if k > 0
                else None
            )
        if config.quantization is not None and not dequantize_fp8:
            # the loader's own conversion (load_target / load_mtp) then finds these already FP8
            convert_target_fp8(target)
            if mtp is not None:
                convert_mtp_fp8(mtp)
        materialize([target, mtp], self.device)
        return target, mtp

    # ---- run -----------------------------------------------------------------------------------------
    def run(self, sched: ScheduledStep) -> StepOutput:
        """The step's target forward and every sequence's new tokens (module docstring)."""
        g = self.graphs
        if g is not None and g.supports(sched) and g.can_propose(sched.decodes):
            return self._run_greedy_graphed(sched)
        return self._run_host_decided(sched)

    def _run_greedy_graphed(self, sched: ScheduledStep) -> StepOutput:
        """Greedy requests with equal numbers of drafts, bucketed (:class:`DecodeGraphs`): the target forward,
        the acceptance and the next drafts all on the device, read with one copy. Every tensor-parallel rank
        computes the same acceptance from the same all-gathered logits."""
        _, spans = self.graphs.run_target(sched.decodes)
        results = self.graphs.run_greedy(spans)
        return StepOutput(spans, [r.tokens for r in results], [r.drafts for r in results], None, None)

    def _run_host_decided(self, sched: ScheduledStep) -> StepOutput:
        """Any step (prompts, mixed draft counts, sampled requests): the target forward (bucketed when
        :meth:`DecodeGraphs.supports` it, else eager), tokens decided on the host (:meth:`_decide`)."""
        if self.graphs is not None:
            self.graphs.forget()  # these tokens are decided here, not where the device advanced them
        graphed = self.graphs is not None and self.graphs.supports(sched)
        if graphed:
            out, spans = self.graphs.run_target(sched.decodes)
            hidden, logits, best = out.hidden, out.logits, out.best
            tables = self.graphs.tables[: len(spans)]
        else:
            batch = self.builder.build(sched)
            spans, tables = batch.spans, batch.tables
            hidden = self.target(batch.input_ids, batch.positions, batch.ctx)
            logits = self.target.compute_logits(hidden[batch.logit_index], torch.float32)
            best = None
        tokens = self._decide(spans, lambda: self._read_tokens(logits, spans, best))
        return StepOutput(spans, tokens, None, hidden, tables)

    def _read_tokens(
        self, logits: torch.Tensor, spans: Sequence[SeqSpan], best: torch.Tensor | None = None
    ) -> HostTokens:
        """The host's view of the step's logits (``best``: their argmax when already computed)."""
        return host_tokens(logits, [(s.request, s.logit_row, s.num_logit_rows) for s in spans], best)

    def _decide(self, spans: Sequence[SeqSpan], read: Callable[[], HostTokens]) -> list[list[int]]:
        """Each sequence's new tokens: a prompt's first token; a decode / verification's accepted drafts and
        one corrected or bonus token (``read``: the host's view of the step's logits, called only where the
        tokens are decided)."""

        def decide() -> list[list[int]]:
            tokens = read()
            out: list[list[int]] = []
            for sp in spans:
                req, r0, m = sp.request, sp.logit_row, sp.num_logit_rows
                if sp.is_prefill:
                    if req.params.greedy:
                        out.append([tokens.best[r0]])
                    else:
                        out.append([sample(tokens.probs[req.request_id][-1], req.generator)])
                elif req.params.greedy:
                    out.append(verify_greedy(tokens.best[r0 : r0 + m], req.drafts)[1])
                else:
                    probs = tokens.probs[req.request_id]
                    out.append(verify_probs(probs, req.drafts, req.draft_probs, req.generator)[1])
            return out

        return self.decider.decide([sp.request for sp in spans], decide, [sp.num_logit_rows for sp in spans])

    # ---- drafting (eager) ----------------------------------------------------------------------------
    def propose(self, out: StepOutput) -> None:
        """After the scheduler booked ``out``'s tokens: the next drafts of every unfinished request that
        drafts, when the step did not compute them on the device."""
        if out.drafts is not None or self.mtp is None:
            return
        items: list[DraftInput] = []
        for i, sp in enumerate(out.spans):
            req = sp.request
            if req.finished or req.num_spec == 0:
                continue
            # MTP rows: target hidden h_i with token t_{i+1}, for every newly accepted position i
            n = req.num_computed - sp.start
            next_tokens = req.token_slice(sp.start + 1, req.num_computed + 1)
            rows = out.hidden[sp.token_offset : sp.token_offset + n]
            items.append(DraftInput(req, sp.start, next_tokens, rows, i))
        if items:
            self._propose(items, out.tables)

    def _propose(self, items: list[DraftInput], tables: torch.Tensor) -> None:
        """First MTP pass over every newly accepted position (varlen), then single-row steps until each
        request has its ``num_spec`` drafts; sets each request's ``drafts`` (and ``draft_probs`` when
        sampled). ``tables``: the step's block tables."""
        b = self.builder
        ids = [t for it in items for t in it.next_tokens]
        pos = b.i64([p for it in items for p in range(it.start, it.start + len(it.next_tokens))])
        hidden = torch.cat([it.hidden for it in items], dim=0)
        table_rows = [it.table_row for it in items]
        if table_rows != list(range(tables.shape[0])):
            tables = tables[b.i64(table_rows)]
        q_lens = [len(it.next_tokens) for it in items]
        last = b.i64(list(itertools.accumulate(q_lens))) - 1
        h, pos = self.proposer.first_pass(b.i64(ids), pos, hidden, b.attn_meta(tables, pos, q_lens), last)
        reqs = [it.request for it in items]
        for req in reqs:
            req.drafts, req.draft_probs = [], None if req.params.greedy else []
        rows = {"reqs": reqs}  # the requests still drafting, in the proposer's row order

        def choose(step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            reqs = rows["reqs"]  # the draft logits are a collective under tensor parallelism: every rank
            drafts = [
                t[0]
                for t in self.decider.decide(reqs, lambda: self._draft_tokens(logits, reqs), [1] * len(reqs))
            ]
            for req, d in zip(reqs, drafts):
                req.drafts.append(d)
            keep = [i for i, r in enumerate(reqs) if r.num_spec > step + 1]
            if len(keep) == len(reqs):
                return b.i64(drafts), None
            rows["reqs"] = [reqs[i] for i in keep]
            return b.i64(drafts), b.i64(keep)

        self.proposer.draft(h, pos, tables, max(r.num_spec for r in reqs), choose)

    @staticmethod
    def _draft_tokens(logits: torch.Tensor, reqs: Sequence[Request]) -> list[list[int]]:
        """One draft per request from the draft logits (greedy: the argmax; sampled: drawn from the
        processed probabilities, kept in ``draft_probs`` for the rejection sampling)."""
        tokens = host_tokens(logits, [(r, i, 1) for i, r in enumerate(reqs)])
        out = []
        for i, req in enumerate(reqs):
            if req.params.greedy:
                out.append([tokens.best[i]])
            else:
                p = tokens.probs[req.request_id][0]
                out.append([sample(p, req.generator)])
                req.draft_probs.append(p)
        return out
