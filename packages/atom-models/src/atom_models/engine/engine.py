"""Standalone engine: continuous batching over a paged KV cache + GDN state slots, MTP speculative decoding.

Each step runs ONE target forward over a flat batch mixing new prompts (prefill), plain decodes (1 token)
and verifications (the pending token plus k drafts), then the MTP draft (one varlen pass over the newly
accepted positions, then k - 1 single-row steps) to propose the next drafts. Each sequence holds ONE GDN
state slot; a verification runs ``gated_delta_rule_verify`` (docs/kernel-api.md, deferred commit): it
commits the tokens the previous step accepted (their raw inputs wait in the pending pool), verifies the new
ones without storing their states and stashes them, so rejected drafts are never recomputed. The conv state
resumes at ``num_accepted`` in its rolled window.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig
from atom_kernels import select_kernels

from atom_models.engine.cache import EngineCaches, kv_cache_dtype
from atom_models.engine.context import AttentionMeta, StepContext
from atom_models.engine.cores import EngineCoreFactory
from atom_models.engine.request import Request, SpecStats
from atom_models.engine.sampling import SamplingParams, probs_from_logits, sample, verify_greedy, verify_probs
from atom_models.gdn_meta import GDNDecodeMeta, GDNPrefillMeta, GDNStepMeta, GDNVerifyMeta
from atom_models.generation_config import with_generation_eos
from atom_models.loader import load_mtp, load_target
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

    def __post_init__(self) -> None:
        kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # validates the name
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


class LLMEngine:
    def __init__(
        self,
        config: Qwen3NextConfig,
        engine_config: EngineConfig = EngineConfig(),
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels=None,
    ):
        k = engine_config.num_speculative_tokens
        if k > 0 and config.num_mtp_layers < 1:
            raise ValueError(f"num_speculative_tokens={k} needs an MTP head, but {config.source} has none")
        self.config = config
        self.engine_config = engine_config
        self.device = torch.device(device)
        self.dtype = dtype
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
        )
        cores = EngineCoreFactory(self.caches, self.kernels)
        with torch.device(self.device):
            self.target = Qwen3NextForCausalLM(config, cores, self.kernels, dtype=dtype)
            self.mtp = (
                Qwen3NextMTP(
                    config,
                    cores,
                    self.kernels,
                    self.target.model.embed_tokens,
                    self.target.lm_head,
                    dtype=dtype,
                )
                if k > 0
                else None
            )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_id = 0

    @classmethod
    def from_pretrained(
        cls, ckpt_dir: str | os.PathLike[str], engine_config: EngineConfig = EngineConfig(), **kwargs
    ) -> LLMEngine:
        """Build from ``<dir>/config.json`` (stopping also on generation_config.json's eos ids) and load."""
        config = with_generation_eos(Qwen3NextConfig.from_hf(ckpt_dir), ckpt_dir)
        engine = cls(config, engine_config, **kwargs)
        load_target(engine.target, ckpt_dir)
        if engine.mtp is not None:
            load_mtp(engine.mtp, ckpt_dir)
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
        return bool(self.waiting or self.running)

    def _blocks_needed(self, req: Request) -> int:
        # positions written: prompt + outputs, plus up to 2k speculative positions (verify + MTP drafts)
        n = len(req.prompt_ids) + req.params.max_tokens + 2 * self.engine_config.num_speculative_tokens + 1
        return math.ceil(n / self.caches.block_size)

    def _admit(self) -> list[Request]:
        budget = self.engine_config.max_num_batched_tokens
        budget -= sum(1 + r.num_spec for r in self.running)
        admitted = []
        while self.waiting:
            req = self.waiting[0]
            need = self._blocks_needed(req)
            if (
                len(self.running) + len(admitted) >= self.engine_config.max_num_seqs
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
                f"request {req.request_id} needs {self._blocks_needed(req)} KV blocks, the cache has "
                f"{self.caches.blocks.num_blocks}: raise num_blocks or max_model_len"
            )
        return admitted

    def _free(self, req: Request) -> None:
        self.caches.blocks.free(req.blocks)
        self.caches.slots.free(req.slot)
        req.blocks, req.slot = [], -1

    # ---- batch description ---------------------------------------------------------------------------
    def _block_tables(self, reqs: list[Request]) -> torch.Tensor:
        """``[N, max_blocks]`` int32 on the device: built once per step (one host-to-device copy)."""
        width = max(len(r.blocks) for r in reqs)
        tables = torch.zeros(len(reqs), width, dtype=torch.int32)
        for i, req in enumerate(reqs):
            tables[i, : len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
        return tables.to(self.device)

    def _attn_meta(self, tables: torch.Tensor, positions: torch.Tensor, q_lens: list[int]) -> AttentionMeta:
        """Varlen batch: sequence i (row i of ``tables``) has ``q_lens[i]`` new tokens at ``positions`` (device
        int64, flat), the last one being its last cached token; slots are computed on the device."""
        bs, n = self.caches.block_size, len(q_lens)
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

    def _decode_meta(self, tables: torch.Tensor, positions: torch.Tensor) -> AttentionMeta:
        """One new token per sequence at ``positions`` (device int64): MTP draft steps >= 1 only advance
        positions / seq_lens over the step's block tables (no host work)."""
        bs, n = self.caches.block_size, positions.shape[0]
        rows = torch.arange(n, device=self.device)
        return AttentionMeta(
            slot_mapping=tables[rows, positions // bs].long() * bs + positions % bs,
            block_tables=tables,
            seq_lens=(positions + 1).int(),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
        )

    def _host_tokens(
        self, logits: torch.Tensor, spans: list[tuple[Request, int, int]]
    ) -> tuple[list[int], dict[int, torch.Tensor]]:
        """What the host needs from device ``logits[R, V]`` for ``spans`` (request, first row, rows):
        the argmax ids of every row (ints, computed on the device) when a request is greedy, and for each
        sampled request the processed probabilities of its rows only (on the CPU, for its generator)."""
        best = logits.argmax(dim=-1).tolist() if any(r.params.greedy for r, _, _ in spans) else []
        probs = {
            r.request_id: probs_from_logits(logits[r0 : r0 + n], r.params).cpu()
            for r, r0, n in spans
            if not r.params.greedy
        }
        return best, probs

    def _i32(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _gdn_step(
        self, prefills: list[Request], decodes: list[Request], num_prefill_tokens: int
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
                cu_seqlens=self._i32(cu),
                state_indices=self._i32([r.slot for r in prefills]),
                has_initial_state=torch.zeros(len(prefills), dtype=torch.bool, device=self.device),
            )
        plain: list[GDNDecodeMeta] = []
        verifies: list[GDNVerifyMeta] = []
        offset = num_prefill_tokens
        for (verify, ql), grp in itertools.groupby(
            decodes, key=lambda r: (r.num_spec > 0, 1 + len(r.drafts))
        ):
            grp = list(grp)
            slots = self._i32([r.slot for r in grp])
            if verify:
                # tokens accepted in the previous step; 1 after the prefill, whose state is committed
                accepted = self._i32([max(1, r.num_accepted) for r in grp])
                verifies.append(GDNVerifyMeta(len(grp), ql, slots, accepted, token_start=offset))
            else:
                plain.append(GDNDecodeMeta(len(grp), slots, token_start=offset))
            offset += len(grp) * ql
        return GDNStepMeta(prefill=prefill, decodes=tuple(plain), verifies=tuple(verifies))

    # ---- one step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepInfo:
        prefills = self._admit()
        if not prefills and not self.running:
            return StepInfo(0, 0, 0, 0, 0, ())
        # contiguous groups of equal q_len (1 + num_spec: every running MTP request holds num_spec drafts)
        decodes = sorted(self.running, key=lambda r: r.num_spec)
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[tuple[Request, int, int]] = []
        for req in prefills:
            n = len(req.prompt_ids)
            ids += req.prompt_ids
            positions += range(n)
            seqs.append((req, 0, n))
        num_prefill_tokens = len(ids)
        for req in decodes:
            q = [req.all_ids[-1], *req.drafts]
            start = req.num_computed
            ids += q
            positions += range(start, start + len(q))
            seqs.append((req, start, len(q)))
        gdn = self._gdn_step(prefills, decodes, num_prefill_tokens)
        tables = self._block_tables([r for r, _, _ in seqs])
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        attn = self._attn_meta(tables, pos, [n for _, _, n in seqs])
        ctx = StepContext(attn=attn, gdn=gdn)
        hidden = self.target(input_ids, pos, ctx)
        new_ids = {r.request_id for r in prefills}
        # logits only where a token is sampled: a prompt's last row, every row of a decode/verify
        rows_needed, spans, start_tok = [], [], 0
        for req, _, n in seqs:
            m = 1 if req.request_id in new_ids else n
            spans.append((req, len(rows_needed), m))
            rows_needed += range(start_tok + n - m, start_tok + n)
            start_tok += n
        logits = self.target.compute_logits(hidden[self._i64(rows_needed)], torch.float32)
        best, probs = self._host_tokens(logits, spans)

        # ---- accept / emit ----
        mtp_rows: list[tuple[Request, int, list[int], torch.Tensor, int]] = []
        emitted_total = 0
        finished: list[Request] = []
        offset = 0
        for i, ((req, start, n), (_, r0, m)) in enumerate(zip(seqs, spans)):
            if req.request_id in new_ids:
                token = best[r0] if req.params.greedy else sample(probs[req.request_id][-1], req.generator)
                accepted_inputs, new = n, [token]  # the whole prompt, then the first sampled token
            else:
                if req.params.greedy:
                    a, new = verify_greedy(best[r0 : r0 + m], req.drafts)
                else:
                    a, new = verify_probs(probs[req.request_id], req.drafts, req.draft_probs, req.generator)
                if req.drafts:
                    req.stats.record(len(req.drafts), a)
                accepted_inputs = a + 1  # the pending token and the accepted drafts
            req.num_steps += 1
            req.num_computed = start + accepted_inputs
            req.num_accepted = 0 if req.request_id in new_ids else accepted_inputs
            emitted_total += self._emit(req, new)
            if req.finished:
                finished.append(req)
            elif self.mtp is not None and req.num_spec > 0:
                # MTP rows: target hidden h_i with token t_{i+1}, for every newly accepted position i
                next_tokens = req.all_ids[start + 1 : req.num_computed + 1]
                mtp_rows.append((req, start, next_tokens, hidden[offset : offset + accepted_inputs], i))
            req.drafts, req.draft_probs = [], None
            offset += n
        self.running = [r for r in self.running if not r.finished] + [r for r in prefills if not r.finished]
        for req in finished:
            self._free(req)
        if mtp_rows:
            self._propose(mtp_rows, tables)
        return StepInfo(
            num_prefills=len(prefills),
            num_decodes=sum(1 for r, _, n in seqs if r.request_id not in new_ids and n == 1),
            num_verifies=sum(1 for r, _, n in seqs if r.request_id not in new_ids and n > 1),
            num_tokens=len(ids),
            num_emitted=emitted_total,
            finished=tuple(r.request_id for r in finished),
        )

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

    # ---- drafting ------------------------------------------------------------------------------------
    def _propose(self, items: list[tuple[Request, int, list[int], torch.Tensor, int]], tables: torch.Tensor):
        """First MTP pass over every newly accepted position, then k - 1 single-row steps. ``items``:
        (request, first position, next tokens, target hidden rows, row in the step's block ``tables``)."""
        mtp = self.mtp
        ids = [t for _, _, toks, _, _ in items for t in toks]
        pos = self._i64([p for _, start, toks, _, _ in items for p in range(start, start + len(toks))])
        hidden = torch.cat([h for _, _, _, h, _ in items], dim=0)
        batch_rows = [row for *_, row in items]
        if batch_rows != list(range(tables.shape[0])):
            tables = tables[self._i64(batch_rows)]
        q_lens = [len(t) for _, _, t, _, _ in items]
        ctx = StepContext(attn=self._attn_meta(tables, pos, q_lens))
        out = mtp(self._i64(ids), pos, hidden, ctx, spec_step=0)
        last = self._i64(list(itertools.accumulate(q_lens))) - 1
        h, pos = out[last], pos[last]
        reqs = [r for r, _, _, _, _ in items]
        for req in reqs:
            req.drafts, req.draft_probs = [], None if req.params.greedy else []
        step = 0
        while True:
            logits = mtp.compute_logits(h, torch.float32)
            best, probs = self._host_tokens(logits, [(r, i, 1) for i, r in enumerate(reqs)])
            for i, req in enumerate(reqs):
                if req.params.greedy:
                    req.drafts.append(best[i])
                else:
                    p = probs[req.request_id][0]
                    req.drafts.append(sample(p, req.generator))
                    req.draft_probs.append(p)
            step += 1
            keep = [i for i, r in enumerate(reqs) if r.num_spec > step]
            if not keep:
                return
            if len(keep) < len(reqs):
                kidx = self._i64(keep)
                reqs = [reqs[i] for i in keep]
                h, pos, tables = h[kidx], pos[kidx], tables[kidx]
            pos = pos + 1
            ctx = StepContext(attn=self._decode_meta(tables, pos))
            h = mtp(self._i64([r.drafts[-1] for r in reqs]), pos, h, ctx, spec_step=step)

    def _i64(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

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
