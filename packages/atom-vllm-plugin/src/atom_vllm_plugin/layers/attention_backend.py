"""ATOM's full-attention backend for vLLM: metadata for atom_kernels' paged attention.

One ``paged_attention`` call serves prefill chunks (with a cached prefix), plain decodes (1 query token)
and verification (1 + k query tokens) mixed in one batch, so the metadata is what the op takes:
``query_start_loc``, ``seq_lens``, ``block_table`` and the ``slot_mapping`` of the new tokens.

KV cache (model dtype, or e4m3 for ``--kv-cache-dtype fp8``): vLLM 0.32 hands each attention layer a logical ``[num_blocks, num_kv_heads, block_size, C]``
view with ``C = 2 * head_dim`` (key then value in the content axis); we ask for the LBNHC physical layout
(``[block, token, head, content]`` in memory) so ``key_cache = view.transpose(1, 2)[..., :D]`` is the
``[B, block_size, Hkv, D]`` cache atom_kernels expects, with unit stride on D.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout


@dataclass
class AtomAttentionMetadata:
    """Per-batch metadata of one KV cache group (tensors on the model's device)."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [N + 1] int32
    seq_lens: torch.Tensor  # [N] int32: tokens in the cache after this step, per request
    block_table: torch.Tensor  # [N, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, < 0: do not write


class AtomAttentionMetadataBuilder(AttentionMetadataBuilder[AtomAttentionMetadata]):
    """Per-step metadata of the plugin's attention layers, built once per step per KV cache group.

    No per-step allocation: every tensor is a view of the model runner's persistent buffers (vLLM's
    ``query_start_loc`` / ``seq_lens`` / block table / ``slot_mapping``; the dtype conversions are no-ops
    for vLLM 0.32's int32 / int64 buffers), and the only Python ints the op reads are fixed by the batch's
    shape, so a CUDA graph captured over this metadata replays with whatever the runner wrote into those
    buffers for the next step.

    CUDA graphs: ``UNIFORM_BATCH``, full graphs for decode and verify batches of ``1 + k`` tokens per request
    (the GDN layers beside these cannot capture a prefill). The op itself takes any mix. Under a full graph
    vLLM pads the batch: ``num_actual_tokens`` is then the padded token count, the padding requests are
    zero-length rows (``query_start_loc`` repeated, ``seq_lens`` 0, block-table row ``NULL_BLOCK_ID``) and
    the padding tokens have slot ``PAD_SLOT_ID`` (-1), so the KV write skips them and the attention writes
    zeros into their rows, all on the device. Without padding it is the real token count and the rows
    after it (vLLM's piecewise token padding) are zeroed.
    """

    # Verification batches of 1 + k tokens per request are "decodes" for our op (it handles any q_len),
    # so vLLM may keep them at the front of the batch like plain decodes: threshold 1 + k.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AtomAttentionMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        # Padded under a full graph (a constant of the captured batch size), else the real token count.
        num_tokens = m.num_actual_tokens
        real = int(m.query_start_loc_cpu[n])
        if num_tokens > real:  # padding tokens write no KV (vLLM fills PAD_SLOT_ID too; made sure here)
            m.slot_mapping[real:num_tokens].fill_(-1)
        return AtomAttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=n,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc[: n + 1].to(torch.int32),
            seq_lens=m.seq_lens[:n].to(torch.int32),
            block_table=m.block_table_tensor[:n].to(torch.int32),
            slot_mapping=m.slot_mapping[:num_tokens].to(torch.int64),
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> AtomAttentionMetadata:
        """The metadata a full graph is captured with: what :meth:`build` gives for the capture batch (every
        tensor a view of vLLM's persistent buffers, so the replayed graph reads each later step's values)."""
        return self.build(0, common_attn_metadata)


class AtomAttentionBackend(AttentionBackend):
    """Paged attention through atom_kernels; the KV write happens inside the layer's forward."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # The op takes any block size, so vLLM's hybrid page alignment may pick whatever it needs.
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("AtomAttentionBackend has no vLLM AttentionImpl: the layer computes itself")

    @staticmethod
    def get_builder_cls() -> type[AtomAttentionMetadataBuilder]:
        return AtomAttentionMetadataBuilder


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer ``[B, Hkv, block_size, 2D]`` view -> (key_cache, value_cache), each ``[B, bs, Hkv, D]``.
    vLLM allocates an fp8 cache as uint8: it is viewed as float8_e4m3fn."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            f"kv_cache: expected vLLM's [num_blocks, num_kv_heads, block_size, {2 * head_size}] view, "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype == torch.uint8:
        kv_cache = kv_cache.view(torch.float8_e4m3fn)
    t = kv_cache.transpose(1, 2)
    return t[..., :head_size], t[..., head_size:]
