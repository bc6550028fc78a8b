"""Standalone engine: continuous batching over a paged KV cache + GDN state slots, MTP speculative decoding.

A step is schedule -> run -> postprocess: the scheduler admits prompts (``scheduler``), the batch
builder lays out ONE target forward over a flat batch mixing new prompts (prefill), plain decodes
(1 token) and verifications (the pending token plus k drafts) (``batch``), the target runs, the host
accepts / emits tokens, then the MTP draft (one pass over the newly accepted positions, then k - 1
single-row steps) proposes the next drafts. Steps without prompts whose requests hold equal numbers of
drafts run padded to a batch-size bucket over persistent buffers, replayed from CUDA graphs on a GPU
(``graphs``); prompts and mixed steps run eagerly. When those requests are all greedy with drafts, the
acceptance and the next drafts are computed on the device too, and the host reads them with one copy
(one host round trip per step), then only books them (:meth:`LLMEngine._accept`). Each sequence holds ONE GDN
state slot; a verification runs ``gated_delta_rule_verify`` (docs/kernel-api.md, deferred commit): it
commits the tokens the previous step accepted (their raw inputs wait in the pending pool), verifies the new
ones without storing their states and stashes them, so rejected drafts are never recomputed. The conv state
resumes at ``num_accepted`` in its rolled window.

Tensor parallelism (``parallel``): every rank holds its shards of the models and caches sized for them,
runs the same scheduler over the same requests (deterministic, so every rank builds the same batches and
runs the same forwards and collectives, CUDA graphs included), and gets the same all-gathered logits. A
step with a sampled request is decided on rank 0 (its request generators) and the tokens broadcast.
Models are built on the meta device and allocated once on the engine's device: an FP8 checkpoint's
quantised modules directly in FP8.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig
from atom_kernels import select_kernels
from torch import nn

from atom_models.engine.batch import BatchBuilder, DraftInput, HostTokens, SeqSpan, host_tokens
from atom_models.engine.cache import EngineCaches, kv_cache_dtype
from atom_models.engine.context import StepContext
from atom_models.engine.cores import EngineCoreFactory
from atom_models.engine.graphs import DecodeGraphs
from atom_models.engine.request import Request, SpecStats
from atom_models.engine.sampling import SamplingParams, sample, verify_greedy, verify_probs
from atom_models.engine.scheduler import ScheduledStep, Scheduler
from atom_models.generation_config import with_generation_eos
from atom_models.loader import convert_mtp_fp8, convert_target_fp8, load_mtp, load_target
from atom_models.parallel import SINGLE_PROCESS, ParallelContext, TPLayout
from atom_models.qwen3_next import Qwen3NextForCausalLM
from atom_models.qwen3_next_mtp import Qwen3NextMTP


@dataclass(frozen=True)
class EngineConfig:
    num_speculative_tokens: int = 0  # k: drafts per verification step (0: no MTP)
    block_size: int = 16
    max_num_seqs: int = 16
    max_model_len: int = 4096
    num_blocks: int | None = None  # default: enough for max_num_seqs sequences of max_model_len
    max_num_batched_tokens: int = 8192  # target tokens per step; a prompt must fit (no chunked prefill)
    kv_cache_dtype: str = "auto"  # vLLM's names: auto (model dtype), bfloat16, float32, fp8, fp8_e4m3
    # bucketed decode/verify steps over persistent buffers, captured as CUDA graphs on a GPU (on a CPU
    # the same bucketed path runs eagerly); None: on when the device is CUDA, off elsewhere
    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # validates the name
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"EngineConfig.cuda_graphs must be a bool or None, got {self.cuda_graphs!r}")
        minimums = {
            "num_speculative_tokens": 0,
            "block_size": 1,
            "max_num_seqs": 1,
            "max_model_len": 1,
            "num_blocks": 1,
            "max_num_batched_tokens": 1,
        }
        for name, low in minimums.items():
            value = getattr(self, name)
            if value is None and name == "num_blocks":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"EngineConfig.{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"EngineConfig.{name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class StepInfo:
    """What one engine step ran (for tests and logs)."""

    num_prefills: int
    num_decodes: int  # sequences with 1 query token
    num_verifies: int  # sequences with 1 + k query tokens, k >= 1
    num_tokens: int
    num_emitted: int
    finished: tuple[int, ...]


@dataclass
class GenerationResult:
    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    stats: SpecStats
    num_steps: int


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


class LLMEngine:
    def __init__(
        self,
        config: Qwen3NextConfig,
        engine_config: EngineConfig = EngineConfig(),
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels=None,
        parallel: ParallelContext = SINGLE_PROCESS,
        dequantize_fp8: bool = False,
    ):
        """``parallel``: this process's tensor-parallel group (every rank builds its shards, sizes its caches
        from :class:`~atom_models.parallel.TPLayout` and runs the same schedule; rank 0 decides sampled
        tokens). With ``config.quantization`` the quantised modules are built in FP8 directly (no copy in
        ``dtype``) unless ``dequantize_fp8``, which keeps every weight in ``dtype``."""
        k = engine_config.num_speculative_tokens
        if k > 0 and config.num_mtp_layers < 1:
            raise ValueError(f"num_speculative_tokens={k} needs an MTP head, but {config.source} has none")
        self.config = config
        self.engine_config = engine_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.parallel = parallel
        self.layout = TPLayout.from_config(config, parallel.rank, parallel.world_size)
        self.dequantize_fp8 = dequantize_fp8
        if kernels is not None:
            kd = torch.device(kernels.device)
            same_device = kd.type == self.device.type and (
                kd.index is None or self.device.index is None or kd.index == self.device.index
            )
            if not same_device or kernels.dtype != dtype:
                raise ValueError(
                    f"kernels: selected for device {kd} / dtype {kernels.dtype}, but the engine runs on "
                    f"device {self.device} / dtype {dtype}"
                )
        self.kernels = kernels if kernels is not None else select_kernels(self.device, dtype)
        ec = engine_config
        bs = ec.block_size
        num_blocks = ec.num_blocks
        if num_blocks is None:
            num_blocks = ec.max_num_seqs * math.ceil((ec.max_model_len + 2 * k + 1) / bs)
        self.caches = EngineCaches(
            config,
            num_blocks=num_blocks,
            block_size=bs,
            max_num_seqs=ec.max_num_seqs,
            num_speculative_tokens=k,
            dtype=dtype,
            device=self.device,
            with_mtp=k > 0,
            kv_dtype=kv_cache_dtype(ec.kv_cache_dtype, dtype),
            layout=self.layout,
        )
        self.target, self.mtp = self._build_models(k)
        self.scheduler = Scheduler(
            self.caches,
            max_num_seqs=ec.max_num_seqs,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            num_speculative_tokens=k,
        )
        self.builder = BatchBuilder(bs, self.device)
        use_graphs = ec.cuda_graphs if ec.cuda_graphs is not None else self.device.type == "cuda"
        self.graphs = (
            DecodeGraphs(
                self.target,
                self.mtp,
                self.builder,
                max_batch=ec.max_num_seqs,
                num_speculative_tokens=k,
                max_blocks=math.ceil((ec.max_model_len + 2 * k + 1) / bs),
                device=self.device,
                # gloo's collectives (ranks sharing a GPU) cannot be captured: the same forwards run eagerly
                capture=self.device.type == "cuda" and parallel.capturable,
            )
            if use_graphs
            else None
        )
        self._next_id = 0

    def _build_models(self, k: int):
        """Target and (k > 0) MTP draft built on the meta device, FP8 modules converted, then allocated on
        the engine's device (uninitialised: the loader or the caller fills them)."""
        config, kernels, dtype, parallel = self.config, self.kernels, self.dtype, self.parallel
        cores = EngineCoreFactory(self.caches, kernels)
        with torch.device("meta"):
            target = Qwen3NextForCausalLM(config, cores, kernels, dtype=dtype, parallel=parallel)
            shared = (target.model.embed_tokens, target.lm_head)
            mtp = (
                Qwen3NextMTP(config, cores, kernels, *shared, dtype=dtype, parallel=parallel)
                if k > 0
                else None
            )
        if config.quantization is not None and not self.dequantize_fp8:
            # the loader's own conversion (load_target / load_mtp) then finds these already FP8
            convert_target_fp8(target)
            if mtp is not None:
                convert_mtp_fp8(mtp)
        materialize([target, mtp], self.device)
        return target, mtp

    @property
    def waiting(self):
        """Requests not admitted yet (FIFO)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """Admitted requests that have not finished."""
        return self.scheduler.running

    @classmethod
    def from_pretrained(
        cls, ckpt_dir: str | os.PathLike[str], engine_config: EngineConfig = EngineConfig(), **kwargs
    ) -> LLMEngine:
        """Build from ``<dir>/config.json`` (stopping also on generation_config.json's eos ids) and load."""
        config = with_generation_eos(Qwen3NextConfig.from_hf(ckpt_dir), ckpt_dir)
        engine = cls(config, engine_config, **kwargs)
        load_target(engine.target, ckpt_dir, dequantize_fp8=engine.dequantize_fp8)
        if engine.mtp is not None:
            load_mtp(engine.mtp, ckpt_dir, dequantize_fp8=engine.dequantize_fp8)
        return engine

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        params = SamplingParams() if params is None else params
        k_max = self.engine_config.num_speculative_tokens
        k = k_max if params.num_speculative_tokens is None else params.num_speculative_tokens
        if not 0 <= k <= k_max:
            raise ValueError(f"num_speculative_tokens={k}: must be in [0, {k_max}] (the engine's k)")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids: empty prompt")
        if any(not 0 <= t < self.config.vocab_size for t in prompt):
            raise ValueError(f"prompt_ids: token ids must be in [0, {self.config.vocab_size})")
        if len(prompt) > self.engine_config.max_num_batched_tokens:
            raise ValueError(
                f"prompt_ids: {len(prompt)} tokens exceed max_num_batched_tokens "
                f"{self.engine_config.max_num_batched_tokens} (prompts are prefilled whole in one step)"
            )
        if len(prompt) + params.max_tokens > self.engine_config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"{self.engine_config.max_model_len}"
            )
        gen = None
        if not params.greedy:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(params.seed if params.seed is not None else 1234 + self._next_id)
        req = Request(self._next_id, prompt, params, k, gen)
        self._next_id += 1
        self.waiting.append(req)
        return req.request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step: schedule -> run -> postprocess ---------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepInfo:
        sched = self.scheduler.schedule()
        if sched.empty:
            return StepInfo(0, 0, 0, 0, 0, ())
        g = self.graphs
        if g is not None and g.supports(sched) and g.can_propose(sched.decodes):
            spans, emitted = self._step_greedy_graphed(sched)
        else:
            spans, emitted = self._step_host_decided(sched)
        finished = self.scheduler.finish_step(sched)
        return StepInfo(
            num_prefills=len(sched.prefills),
            num_decodes=sum(1 for s in spans if not s.is_prefill and s.num_tokens == 1),
            num_verifies=sum(1 for s in spans if not s.is_prefill and s.num_tokens > 1),
            num_tokens=sum(s.num_tokens for s in spans),
            num_emitted=emitted,
            finished=tuple(r.request_id for r in finished),
        )

    def _step_greedy_graphed(self, sched: ScheduledStep) -> tuple[tuple[SeqSpan, ...], int]:
        """Greedy requests with equal numbers of drafts, bucketed (:class:`DecodeGraphs`): the target forward,
        the acceptance and the next drafts all on the device, read with one copy (one host round trip),
        then per request the host's bookkeeping only. Every tensor-parallel rank computes the same
        acceptance from the same all-gathered logits."""
        _, spans = self.graphs.run_target(sched.decodes)
        emitted = 0
        for sp, res in zip(spans, self.graphs.run_greedy(spans)):
            emitted += self._accept(sp, res.tokens)
            req = sp.request
            req.drafts = [] if req.finished else res.drafts
        return spans, emitted

    def _step_host_decided(self, sched: ScheduledStep) -> tuple[tuple[SeqSpan, ...], int]:
        """Any step (prompts, mixed draft counts, sampled requests): the target forward (bucketed when
        :meth:`DecodeGraphs.supports` it, else eager), tokens decided on the host (:meth:`_decide`), then
        the eager MTP draft."""
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
        new_tokens = self._decide(spans, lambda: self._read_tokens(logits, spans, best))
        emitted, drafts_in = self._postprocess(spans, new_tokens, hidden)
        if drafts_in:
            self._propose(drafts_in, tables)
        return spans, emitted

    def _read_tokens(
        self, logits: torch.Tensor, spans: Sequence[SeqSpan], best: torch.Tensor | None = None
    ) -> HostTokens:
        """The host's view of the step's logits (``best``: their argmax when already computed)."""
        return host_tokens(logits, [(s.request, s.logit_row, s.num_logit_rows) for s in spans], best)

    def _rank0_decides(self, reqs: Sequence[Request]) -> bool:
        """Under tensor parallelism a step with a sampled request is decided on rank 0 alone (its request
        generators) and broadcast, so that the ranks cannot diverge; greedy steps are decided on every rank
        from the same (all-gathered) logits."""
        return self.parallel.world_size > 1 and any(not r.params.greedy for r in reqs)

    def _broadcast_tokens(
        self, tokens: list[list[int]] | None, widths: Sequence[int], failed: bool = False
    ) -> list[list[int]]:
        """Rank 0's token lists (``len(tokens[i]) <= widths[i]``) on every rank (``tokens``: None off rank
        0): one broadcast of an int64 ``[n, 1 + max(widths)]`` tensor of lengths and ids. ``failed`` (rank
        0): lengths of -1, on which the other ranks raise instead of waiting for a step that never comes."""
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

    def _rank0_decision(
        self, decide: Callable[[], list[list[int]]], widths: Sequence[int]
    ) -> list[list[int]]:
        """``decide()`` on rank 0, its result broadcast to every rank; if it raises, the other ranks are
        told (and raise) before rank 0 re-raises."""
        if self.parallel.rank != 0:
            return self._broadcast_tokens(None, widths)
        try:
            out = decide()
        except Exception:
            self._broadcast_tokens(None, widths, failed=True)
            raise
        return self._broadcast_tokens(out, widths)

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

        if self._rank0_decides([sp.request for sp in spans]):
            return self._rank0_decision(decide, [sp.num_logit_rows for sp in spans])
        return decide()

    def _postprocess(
        self, spans: Sequence[SeqSpan], new_tokens: Sequence[list[int]], hidden: torch.Tensor
    ) -> tuple[int, list[DraftInput]]:
        """Accept / emit every sequence's ``new_tokens`` (:meth:`_decide`); returns the tokens emitted and,
        from the step's target ``hidden``, the first MTP pass's input of every unfinished request with
        drafts."""
        drafts_in: list[DraftInput] = []
        emitted = 0
        for i, (sp, new) in enumerate(zip(spans, new_tokens)):
            req = sp.request
            emitted += self._accept(sp, new)
            if not req.finished and self.mtp is not None and req.num_spec > 0:
                # MTP rows: target hidden h_i with token t_{i+1}, for every newly accepted position i
                n = req.num_computed - sp.start
                next_tokens = req.token_slice(sp.start + 1, req.num_computed + 1)
                rows = hidden[sp.token_offset : sp.token_offset + n]
                drafts_in.append(DraftInput(req, sp.start, next_tokens, rows, i))
            req.drafts, req.draft_probs = [], None
        return emitted, drafts_in

    def _accept(self, sp: SeqSpan, new: list[int]) -> int:
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
        return self._emit(req, new)

    def _emit(self, req: Request, tokens: list[int]) -> int:
        eos = () if req.params.ignore_eos else self.config.eos_token_id
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

    # ---- drafting (eager) ----------------------------------------------------------------------------
    def _propose(self, items: list[DraftInput], tables: torch.Tensor) -> None:
        """First MTP pass over every newly accepted position (varlen), then k - 1 single-row steps; sets
        each request's ``drafts`` (and ``draft_probs`` when sampled). ``tables``: the step's block tables."""
        mtp, b = self.mtp, self.builder
        ids = [t for it in items for t in it.next_tokens]
        pos = b.i64([p for it in items for p in range(it.start, it.start + len(it.next_tokens))])
        hidden = torch.cat([it.hidden for it in items], dim=0)
        table_rows = [it.table_row for it in items]
        if table_rows != list(range(tables.shape[0])):
            tables = tables[b.i64(table_rows)]
        q_lens = [len(it.next_tokens) for it in items]
        ctx = StepContext(attn=b.attn_meta(tables, pos, q_lens))
        out = mtp(b.i64(ids), pos, hidden, ctx, spec_step=0)
        last = b.i64(list(itertools.accumulate(q_lens))) - 1
        h, pos = out[last], pos[last]
        reqs = [it.request for it in items]
        for req in reqs:
            req.drafts, req.draft_probs = [], None if req.params.greedy else []
        step = 0
        while True:
            logits = mtp.compute_logits(h, torch.float32)  # collective under tensor parallelism: every rank

            def propose(logits=logits, reqs=reqs) -> list[list[int]]:
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

            if self._rank0_decides(reqs):
                drafts = [t[0] for t in self._rank0_decision(propose, [1] * len(reqs))]
            else:
                drafts = [t[0] for t in propose()]
            for req, d in zip(reqs, drafts):
                req.drafts.append(d)
            step += 1
            keep = [i for i, r in enumerate(reqs) if r.num_spec > step]
            if not keep:
                return
            if len(keep) < len(reqs):
                kidx = b.i64(keep)
                reqs = [reqs[i] for i in keep]
                h, pos, tables = h[kidx], pos[kidx], tables[kidx]
            pos = pos + 1
            ctx = StepContext(attn=b.decode_meta(tables, pos))
            h = mtp(b.i64([r.drafts[-1] for r in reqs]), pos, h, ctx, spec_step=step)

    # ---- convenience ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion (continuous batching); results in prompt order."""
        params = SamplingParams() if params is None else params
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(
                f"params: expected {len(prompts)} SamplingParams (one per prompt), got {len(plist)}"
            )
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        reqs = {r.request_id: r for r in self.waiting if r.request_id in set(ids)}
        while self.has_unfinished():
            info = self.step()
            if progress is not None:
                progress(info.num_emitted)
        return [
            GenerationResult(
                r.request_id, r.prompt_ids, r.output_ids, r.finish_reason or "", r.stats, r.num_steps
            )
            for r in (reqs[i] for i in ids)
        ]
