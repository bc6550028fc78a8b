"""ATOM's Gated DeltaNet backend for vLLM: vLLM's GDN metadata, plus the GDN pipeline's per-step record.

vLLM's model runner passes ``num_accepted_tokens`` / ``num_decode_draft_tokens_cpu`` only to builders that
are instances of ``GDNAttentionMetadataBuilder``, so our builder subclasses it. After vLLM's own ``build``
it translates the result ONCE per step into ``atom_models``' :class:`GDNStepMeta` (host work on vLLM's
CPU copies of the batch layout, one copy into persistent device buffers), which every GDN layer of the
group then reads without host work. The layers name this backend, so they never reach vLLM's kernels.

Deferred-commit verification needs only the request's own slot: ``AtomGDNCore.get_kv_cache_spec`` asks for
no speculative state blocks, so column 0 of vLLM's spec state indices is the slot (in "align" mode, the
block of the step's last token). With prefix caching the record carries, for prompt chunks, each sequence's
context length, so that a chunk resuming from a shared snapshot commits its pending tokens first; the
step's whole-slot copies between blocks run outside the forward (``patches.mamba_align`` under vLLM's V1
runner, ``model_state`` under Model Runner V2).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import numpy as np
import torch
from atom_models.gdn_meta import (
    GDNDecodeMeta,
    GDNPrefillMeta,
    GDNStepMeta,
    GDNVerifyMeta,
)
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend,
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)

from atom_vllm_plugin.layers.host_copy import to_device


@dataclass
class AtomGDNAttentionMetadata(GDNAttentionMetadata):
    """vLLM's GDN metadata with the GDN pipeline's record for the same step (and the batch layout the
    record was made from, which :meth:`AtomGDNAttentionMetadataBuilder.update_block_table` reads again)."""

    step: GDNStepMeta | None = None
    common: CommonAttentionMetadata | None = field(default=None, repr=False)


class StepBuffers:
    """Persistent device buffers the per-step verify indices are copied into (``max_seqs`` requests of up
    to ``max_q`` tokens), so the record's tensors keep their addresses from step to step."""

    def __init__(self, max_seqs: int, max_q: int, device: torch.device):
        self.slots = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.num_accepted = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.gather = torch.zeros(max_seqs * max_q, dtype=torch.int64, device=device)
        self.scatter = torch.zeros(max_seqs * max_q, dtype=torch.int64, device=device)


PAD_SLOT = -1  # a state index the GDN kernels skip (no state read or written)


def _put(buf: torch.Tensor | None, src: torch.Tensor) -> torch.Tensor:
    """``src`` copied into the front of ``buf`` (a view of it); ``src`` itself (contiguous) without a buffer
    or where it does not fit."""
    if buf is None or src.shape[0] > buf.shape[0]:
        return src.contiguous()
    out = buf[: src.shape[0]]
    out.copy_(src, non_blocking=True)
    return out


def _padded(buf: torch.Tensor | None, head: torch.Tensor, total: int, pad: int) -> torch.Tensor:
    """``[total]`` int32: ``head``, then ``pad`` in the rows after it; the front of ``buf`` where it fits,
    so a full graph captured at ``total`` rows reads this step's values, padding rows included."""
    n = head.shape[0]
    if buf is None or total > buf.shape[0]:
        out = torch.full((total,), pad, dtype=torch.int32, device=head.device)
    else:
        out = buf[:total]
        out[n:].fill_(pad)
    out[:n].copy_(head, non_blocking=True)
    return out


def _decode_meta(md: GDNAttentionMetadata, bufs: StepBuffers | None) -> GDNDecodeMeta:
    """The ``num_decodes`` one-token rows at the front of the batch. A full graph's padded batch counts its
    zero-length padding rows among them (vLLM gives them the null block): their slot becomes ``PAD_SLOT``."""
    n = md.num_decodes
    slots = md.non_spec_state_indices_tensor[:n].to(torch.int32)
    qsl = md.non_spec_query_start_loc
    if qsl is not None and qsl.shape[0] > n:
        slots = torch.where(qsl[1 : n + 1] > qsl[:n], slots, PAD_SLOT)
    return GDNDecodeMeta(n, _padded(None if bufs is None else bufs.slots, slots, n, PAD_SLOT))


def _verify_meta(
    md: GDNAttentionMetadata, m: CommonAttentionMetadata, bufs: StepBuffers | None
) -> GDNVerifyMeta:
    """The spec rows of ``md`` (the first ``num_spec_decodes`` rows flagged in ``spec_sequence_masks_cpu``)
    as one verify part of ``Q = max(lens)`` tokens; ragged or scattered rows get gather/scatter indices.

    A uniform batch (every row ``Q`` tokens, in order from row 0, nothing else) keeps the zero-length
    padding rows of a full graph's padded batch (``m.num_actual_tokens == m.num_reqs * Q``) as verify rows
    with slot ``PAD_SLOT`` and ``num_accepted = 1``: the record then has the captured batch's shape.
    """
    n = md.num_spec_decodes
    dev = md.spec_state_indices_tensor.device
    qsl = m.query_start_loc_cpu.numpy().astype(np.int64)
    mask = md.spec_sequence_masks_cpu.numpy().astype(bool)
    rows = np.arange(mask.shape[0])[mask][:n]
    starts = qsl[rows]
    lens = qsl[rows + 1] - starts
    q_len = int(max(int(lens.max()), 1))
    slots = md.spec_state_indices_tensor[:n, 0].to(torch.int32)
    accepted = md.num_accepted_tokens[:n].to(torch.int32)
    b_slots = None if bufs is None else bufs.slots
    b_acc = None if bufs is None else bufs.num_accepted
    if bool((lens == q_len).all()) and bool((starts == starts[0] + q_len * np.arange(n)).all()):
        total = n
        only_verify = md.num_prefills == 0 and md.num_decodes == 0 and starts[0] == 0
        if only_verify and m.num_reqs > n and m.num_actual_tokens == m.num_reqs * q_len:
            total = m.num_reqs
        slots, accepted = _padded(b_slots, slots, total, PAD_SLOT), _padded(b_acc, accepted, total, 1)
        return GDNVerifyMeta(total, q_len, slots, accepted, token_start=int(starts[0]))
    slots, accepted = _put(b_slots, slots), _put(b_acc, accepted)
    col = np.arange(q_len)[None, :]
    gather = starts[:, None] + np.minimum(col, np.maximum(lens - 1, 0)[:, None])
    scatter = np.where(col < lens[:, None], starts[:, None] + col, -1)
    gather_t = to_device(gather.reshape(-1), dev)
    scatter_t = to_device(scatter.reshape(-1), dev)
    if bufs is not None:
        gather_t, scatter_t = _put(bufs.gather, gather_t), _put(bufs.scatter, scatter_t)
    return GDNVerifyMeta(n, q_len, slots, accepted, gather_index=gather_t, scatter_index=scatter_t)


def _prefill_context_lens(
    md: GDNAttentionMetadata, m: CommonAttentionMetadata, spec_rows: bool
) -> np.ndarray:
    """Tokens each prefill row had before this step (int32, in the prefill part's order): vLLM's host upper
    bound of ``seq_lens`` is exact for prefill rows. Both of vLLM's runners pass it (vLLM's own GDN builder
    requires it too); reading the device ``seq_lens`` instead would stall the step on the device."""
    qsl = m.query_start_loc_cpu.numpy().astype(np.int64)
    nr = qsl.shape[0] - 1
    if m.seq_lens_cpu_upper_bound is None:
        raise ValueError(
            "GDN metadata of a prompt chunk needs CommonAttentionMetadata.seq_lens_cpu_upper_bound (the host "
            "copy of seq_lens that vLLM's model runners pass)"
        )
    seq = m.seq_lens_cpu_upper_bound[:nr].numpy().astype(np.int64)
    ctx = seq - (qsl[1:] - qsl[:-1])
    if spec_rows:
        rows = np.arange(nr)[~md.spec_sequence_masks_cpu.numpy().astype(bool)[:nr]]
    else:
        rows = np.arange(md.num_decodes, md.num_decodes + md.num_prefills)
    return ctx[rows[: md.num_prefills]].astype(np.int32)


def gdn_step_from_vllm(
    md: GDNAttentionMetadata, m: CommonAttentionMetadata, bufs: StepBuffers | None = None
) -> GDNStepMeta:
    """Translate vLLM's GDN metadata of one step (``m``: the batch's common metadata, whose host copy of
    ``query_start_loc`` gives the rows) into the pipeline's record.

    Without spec rows vLLM puts the one-token decodes first, then the prompt chunks (contiguous). With spec
    rows (verifications) it counts every other row as a prefill (a one-token one included), and the two
    kinds may interleave: ``non_spec_token_indx`` lists the prefill rows.
    """
    prefill = None
    if md.num_prefills > 0:
        n = md.num_prefills
        token_index = None
        spec_rows = md.spec_sequence_masks is not None and md.num_spec_decodes > 0
        if spec_rows:
            token_index = md.non_spec_token_indx[: md.num_prefill_tokens].long()
        context = _prefill_context_lens(md, m, spec_rows)
        prefill = GDNPrefillMeta(
            num_seqs=n,
            num_tokens=md.num_prefill_tokens,
            cu_seqlens=md.prefill_query_start_loc[: n + 1].to(torch.int32),
            state_indices=md.prefill_state_indices[:n].to(torch.int32),
            has_initial_state=md.prefill_has_initial_state[:n],
            token_start=md.num_decode_tokens,
            token_index=token_index,
            context_lens=to_device(context, md.prefill_query_start_loc.device),
            resume_pending=bool((context > 0).any()),
        )
    decodes: tuple[GDNDecodeMeta, ...] = ()
    if md.num_decodes > 0:
        decodes = (_decode_meta(md, bufs),)
    verifies: tuple[GDNVerifyMeta, ...] = ()
    if md.spec_sequence_masks is not None and md.num_spec_decodes > 0:
        verifies = (_verify_meta(md, m, bufs),)
    return GDNStepMeta(prefill=prefill, decodes=decodes, verifies=verifies)


class AtomGDNAttentionMetadataBuilder(GDNAttentionMetadataBuilder):
    """vLLM's GDN metadata (the reorder threshold is 1 + k: a verification batch counts as a decode) and
    the GDN pipeline's record of the same step.

    CUDA graphs: ``UNIFORM_BATCH``, as vLLM's own builder, with or without prefix caching: full graphs for decode batches (k = 0) and
    verify batches of ``1 + k`` tokens per request. The record's decode and verify parts hold only views of
    ``StepBuffers`` (refilled in place every step) and ints fixed by the batch's shape, and the zero-length
    padding rows of a padded batch become rows with slot ``PAD_SLOT`` (``num_accepted`` 1), which the
    kernels skip on the device; so a graph captured at one batch size replays correctly for any real batch
    padded to it. ``build_for_cudagraph_capture`` is vLLM's (it calls :meth:`build`). A batch with a prompt
    chunk runs outside full graphs (vLLM's piecewise graphs around the ``vllm::atom_gdn_core`` op).
    With prefix caching ("align" mode) the slots are vLLM's block of each request's last token, and the
    whole-slot copies between blocks, which vary from step to step, run before and after the forward
    (``patches.mamba_align`` / ``model_state``), so the record has the same shape as without prefix
    caching. This builder does not take Model Runner V2's precomputed aligned state indices (it has no
    ``mamba_aligned_state_indices``): vLLM's ``build`` reads the block of each request's last token from the
    block table, the column the plugin's snapshot plan computes in.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        max_seqs = vllm_config.scheduler_config.max_num_seqs
        self.step_buffers = StepBuffers(max_seqs, self.num_spec + 1, device)
        # vLLM builds the first GDN group's metadata of a step and asks the builders of the other groups
        # (same spec, other state slots) only to re-gather their state indices (vLLM 0.32 turns this on for
        # its own builder under Model Runner V2 only; align mode's re-gather needs V2's precomputed indices).
        self.supports_update_block_table = vllm_config.cache_config.mamba_cache_mode != "align"

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ) -> AtomGDNAttentionMetadata:
        md = super().build(
            common_prefix_len,
            common_attn_metadata,
            num_accepted_tokens,
            num_decode_draft_tokens_cpu,
            fast_build,
        )
        step = gdn_step_from_vllm(md, common_attn_metadata, self.step_buffers)
        return AtomGDNAttentionMetadata(
            **{f.name: getattr(md, f.name) for f in fields(md)}, step=step, common=common_attn_metadata
        )

    def update_block_table(
        self, metadata: AtomGDNAttentionMetadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> AtomGDNAttentionMetadata:
        """This group's metadata from another GDN group's of the same step: vLLM's re-gather of the state
        indices from this group's block table (staged in this builder's buffers), then the record made
        again from them into this builder's ``StepBuffers`` (a full graph of this group's layers was
        captured over these buffers). vLLM's batch-level work (``build``) runs once per step, not per group."""
        if metadata.common is None:
            raise ValueError(
                "update_block_table: the metadata was not made by AtomGDNAttentionMetadataBuilder.build"
            )
        md = super().update_block_table(metadata, blk_table, slot_mapping)
        return replace(md, step=gdn_step_from_vllm(md, metadata.common, self.step_buffers))


class AtomGDNAttentionBackend(GDNAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "GDN_ATTN"

    @staticmethod
    def get_builder_cls() -> type[AtomGDNAttentionMetadataBuilder]:
        return AtomGDNAttentionMetadataBuilder
