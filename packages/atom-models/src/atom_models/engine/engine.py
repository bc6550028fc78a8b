"""Standalone engine: continuous batching over a paged KV cache + GDN state slots, MTP speculative decoding.

A step is schedule -> run -> postprocess, as in nano-vllm:

- the :class:`~atom_models.engine.scheduler.Scheduler` admits prompts and lays out the step (every running
  request, sorted by its number of drafts);
- the :class:`~atom_models.engine.model_runner.ModelRunner` runs ONE target forward over the flat batch
  mixing new prompts (prefill), plain decodes (1 token) and verifications (the pending token plus k
  drafts), and decides each sequence's new tokens (on the device with the next drafts for bucketed greedy
  steps, on the host otherwise);
- the scheduler books them (accept, emit, finish), and the runner drafts the next tokens of the requests
  the step did not draft on the device (the MTP proposer: one pass over the newly accepted positions, then
  single-row steps).

Each sequence holds ONE GDN state slot; a verification runs ``gated_delta_rule_verify``
(docs/kernel-api.md, deferred commit): it commits the tokens the previous step accepted (their raw inputs
wait in the pending pool), verifies the new ones without storing their states and stashes them, so
rejected drafts are never recomputed. The conv state resumes at ``num_accepted`` in its rolled window.

Tensor parallelism (``parallel``): every rank holds its shards of the models and caches sized for them,
runs the same scheduler over the same requests (deterministic, so every rank builds the same batches and
runs the same forwards and collectives, CUDA graphs included), and gets the same all-gathered logits. A
decision involving a sampled request is made on rank 0 (its request generators) and the tokens broadcast
(:mod:`~atom_models.engine.tp_decide`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig
from atom_kernels import select_kernels

from atom_models.engine.batch import BatchBuilder
from atom_models.engine.cache import EngineCaches, kv_cache_dtype
from atom_models.engine.graphs import DecodeGraphs
from atom_models.engine.model_runner import ModelRunner
from atom_models.engine.request import Request, SpecStats
from atom_models.engine.sampling import SamplingParams
from atom_models.engine.scheduler import Scheduler
from atom_models.generation_config import with_generation_eos
from atom_models.loader import load_mtp, load_target
from atom_models.moe import hold_float32_experts
from atom_models.parallel import SINGLE_PROCESS, ParallelContext, TPLayout
from atom_models.parallel.linear import hold_packed_linears
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
    # tensor parallel: partition the routed experts over the ranks, each rank holding and loading 1/tp of
    # them whole (TPLayout), instead of splitting every expert over its intermediate dimension
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # validates the name
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"EngineConfig.expert_parallel must be a bool, got {self.expert_parallel!r}")
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
        self.layout = TPLayout.from_config(
            config, parallel.rank, parallel.world_size, engine_config.expert_parallel
        )
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
        self.runner = ModelRunner(
            config,
            self.caches,
            self.kernels,
            num_speculative_tokens=k,
            max_num_seqs=ec.max_num_seqs,
            max_model_len=ec.max_model_len,
            block_size=bs,
            cuda_graphs=ec.cuda_graphs,
            dtype=dtype,
            device=self.device,
            parallel=parallel,
            dequantize_fp8=dequantize_fp8,
            expert_parallel=engine_config.expert_parallel,
        )
        self.scheduler = Scheduler(
            self.caches,
            max_num_seqs=ec.max_num_seqs,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            num_speculative_tokens=k,
            eos_token_id=config.eos_token_id,
        )
        self._next_id = 0

    @property
    def target(self) -> Qwen3NextForCausalLM:
        return self.runner.target

    @property
    def mtp(self) -> Qwen3NextMTP | None:
        return self.runner.mtp

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The bucketed decode / verify steps (CUDA graphs on a GPU), or None."""
        return self.runner.graphs

    @property
    def builder(self) -> BatchBuilder:
        return self.runner.builder

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
        # CPU expert backends take float32 weights, the cpu linears packed bf16 weights: made once here
        # rather than on every call
        for model in (engine.target, engine.mtp):
            if model is not None:
                hold_float32_experts(model, engine.kernels)
                hold_packed_linears(model, engine.kernels)
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
        out = self.runner.run(sched)
        emitted, finished = self.scheduler.postprocess(sched, out.spans, out.tokens, out.drafts)
        self.runner.propose(out)
        spans = out.spans
        return StepInfo(
            num_prefills=len(sched.prefills),
            num_decodes=sum(1 for s in spans if not s.is_prefill and s.num_tokens == 1),
            num_verifies=sum(1 for s in spans if not s.is_prefill and s.num_tokens > 1),
            num_tokens=sum(s.num_tokens for s in spans),
            num_emitted=emitted,
            finished=tuple(r.request_id for r in finished),
        )

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
