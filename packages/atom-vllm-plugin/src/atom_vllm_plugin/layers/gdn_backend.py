"""ATOM's Gated DeltaNet backend for vLLM: vLLM's GDN metadata, plus the GDN pipeline's per-step record.

vLLM's model runner passes ``num_accepted_tokens`` / ``num_decode_draft_tokens_cpu`` only to builders that
are instances of ``GDNAttentionMetadataBuilder``, so our builder subclasses it. After vLLM's own ``build``
it translates the result into ``atom_models``' :class:`GDNStepMeta`, which every GDN layer of the group
then reads without host work: the step's layout (``gdn_layout``: host work on vLLM's CPU copies of the
batch layout, once per step for all GDN groups) plus the group's own state slots, copied into the
builder's persistent device buffers. The layers name this backend, so they never reach vLLM's kernels.

Deferred-commit verification needs only the request's own slot: ``AtomGDNCore.get_kv_cache_spec`` asks for
no speculative state blocks, so column 0 of vLLM's spec state indices is the slot (in "align" mode, the
block of the step's last token). With prefix caching the record carries, for prompt chunks, each sequence's
context length, so that a chunk resuming from a shared snapshot commits its pending tokens first; the
step's whole-slot copies between blocks run outside the forward (``patches.mamba_align`` under vLLM's V1
runner, ``model_state`` under Model Runner V2).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

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

from atom_vllm_plugin.layers.gdn_layout import (
    DecodeLayout,
    LayoutCache,
    PrefillLayout,
    StepLayout,
    VerifyLayout,
    has_spec_rows,
    step_layout,
)


@dataclass
class AtomGDNAttentionMetadata(GDNAttentionMetadata):
    """vLLM's GDN metadata with the GDN pipeline's record for the same step (and the step's layout the
    record was made from, which :meth:`AtomGDNAttentionMetadataBuilder.update_block_table` reuses)."""

    step: GDNStepMeta | None = None
    layout: StepLayout | None = field(default=None, repr=False)


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
        if n < total:
            out[n:].fill_(pad)
    (out if n == total else out[:n]).copy_(head, non_blocking=True)
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _decode_part(lay: DecodeLayout, slots: torch.Tensor, bufs: StepBuffers | None) -> GDNDecodeMeta:
    """The decode part with this group's ``slots`` (vLLM's state index of each decode row, in row order):
    padding rows get ``PAD_SLOT``."""
    n = lay.num_rows
    buf = None if bufs is None else bufs.slots
    if lay.real_mask is not None:
        return GDNDecodeMeta(
            n, _padded(buf, _int32(torch.where(lay.real_mask, slots[:n], PAD_SLOT)), n, PAD_SLOT)
        )
    return GDNDecodeMeta(n, _padded(buf, _int32(slots[: lay.real_rows]), n, PAD_SLOT))


def _verify_part(
    lay: VerifyLayout, slots: torch.Tensor, accepted: torch.Tensor, bufs: StepBuffers | None
) -> GDNVerifyMeta:
    """The verify part with this group's ``slots`` (vLLM's spec state indices: column 0 of the first
    ``num_seqs`` rows) and ``accepted`` (at least ``num_seqs`` rows; rows from ``num_seqs`` on are taken as
    given where there are ``total`` of them, else padded with 1)."""
    n, total = lay.num_seqs, lay.total
    slots = _int32(slots[:n, 0])
    accepted = _int32(accepted[:total] if accepted.shape[0] >= total else accepted[:n])
    b_slots = None if bufs is None else bufs.slots
    b_acc = None if bufs is None else bufs.num_accepted
    if lay.gather is None:
        slots, accepted = _padded(b_slots, slots, total, PAD_SLOT), _padded(b_acc, accepted, total, 1)
        return GDNVerifyMeta(total, lay.q_len, slots, accepted, token_start=lay.token_start)
    gather, scatter = lay.gather, lay.scatter
    if bufs is not None:
        gather, scatter = _put(bufs.gather, gather), _put(bufs.scatter, scatter)
    slots, accepted = _put(b_slots, slots), _put(b_acc, accepted)
    return GDNVerifyMeta(n, lay.q_len, slots, accepted, gather_index=gather, scatter_index=scatter)


def _prefill_part(md: GDNAttentionMetadata, lay: PrefillLayout) -> GDNPrefillMeta:
    n = md.num_prefills
    token_index = None
    if has_spec_rows(md):
        token_index = md.non_spec_token_indx[: md.num_prefill_tokens].long()
    return GDNPrefillMeta(
        num_seqs=n,
        num_tokens=md.num_prefill_tokens,
        cu_seqlens=_int32(md.prefill_query_start_loc[: n + 1]),
        state_indices=_int32(md.prefill_state_indices[:n]),
        has_initial_state=md.prefill_has_initial_state[:n],
        token_start=md.num_decode_tokens,
        token_index=token_index,
        context_lens=lay.context_lens,
        resume_pending=lay.resume_pending,
    )


def step_record(
    lay: StepLayout, md: GDNAttentionMetadata, bufs: StepBuffers | None, accepted: torch.Tensor | None = None
) -> GDNStepMeta:
    """The record of the step ``lay`` describes, with the state slots of vLLM's metadata ``md`` of one
    group: its decode / verify tensors in ``bufs``. ``accepted``: the verify rows' accepted counts (default
    vLLM's ``md.num_accepted_tokens``)."""
    prefill = None if lay.prefill is None else _prefill_part(md, lay.prefill)
    decodes: tuple[GDNDecodeMeta, ...] = ()
    if lay.decode is not None:
        decodes = (_decode_part(lay.decode, md.non_spec_state_indices_tensor, bufs),)
    verifies: tuple[GDNVerifyMeta, ...] = ()
    if lay.verify is not None:
        acc = md.num_accepted_tokens if accepted is None else accepted
        verifies = (_verify_part(lay.verify, md.spec_state_indices_tensor, acc, bufs),)
    return GDNStepMeta(prefill=prefill, decodes=decodes, verifies=verifies)


def gdn_step_from_vllm(
    md: GDNAttentionMetadata, m: CommonAttentionMetadata, bufs: StepBuffers | None = None
) -> GDNStepMeta:
    """Translate vLLM's GDN metadata of one step (``m``: the batch's common metadata, whose host copy of
    ``query_start_loc`` gives the rows) into the pipeline's record.

    Without spec rows vLLM puts the one-token decodes first, then the prompt chunks (contiguous). With spec
    rows (verifications) it counts every other row as a prefill (a one-token one included), and the two
    kinds may interleave: ``non_spec_token_indx`` lists the prefill rows.
    """
    return step_record(step_layout(md, m, _device_of(md)), md, bufs)


def _device_of(md: GDNAttentionMetadata) -> torch.device:
    """Where vLLM's metadata lives (the device of its state indices)."""
    for t in (md.spec_state_indices_tensor, md.non_spec_state_indices_tensor, md.prefill_query_start_loc):
        if t is not None:
            return t.device
    return torch.device("cpu")


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
    # The step's layout, shared by the builders of every GDN group (in align mode each group builds): a
    # group's build reuses it only for the same step (see ``LayoutCache``).
    _layouts: ClassVar[LayoutCache] = LayoutCache()

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
        if self.supports_update_block_table:  # the one build of the step
            layout = step_layout(md, common_attn_metadata, self.device)
        else:  # every group builds: the step's first build makes the layout
            layout = self._layouts.get(md, common_attn_metadata, self.device)
        step = step_record(layout, md, self.step_buffers)
        return AtomGDNAttentionMetadata(
            **{f.name: getattr(md, f.name) for f in fields(md)}, step=step, layout=layout
        )

    def update_block_table(
        self, metadata: AtomGDNAttentionMetadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> AtomGDNAttentionMetadata:
        """This group's metadata from another GDN group's of the same step: vLLM's re-gather of the state
        indices from this group's block table (staged in this builder's buffers), then the record of that
        step's layout with these slots, in this builder's ``StepBuffers`` (a full graph of this group's
        layers was captured over these buffers): the slots copied, the accepted counts copied from the other
        group's record, nothing read from the host."""
        if metadata.layout is None or metadata.step is None:
            raise ValueError(
                "update_block_table: the metadata was not made by AtomGDNAttentionMetadataBuilder.build"
            )
        md = super().update_block_table(metadata, blk_table, slot_mapping)
        verifies = metadata.step.verifies
        accepted = verifies[0].num_accepted if verifies else None
        # ``md`` is vLLM's fresh copy of ``metadata`` (its ``layout`` carried over); only the record is new
        md.step = step_record(metadata.layout, md, self.step_buffers, accepted)
        return md


class AtomGDNAttentionBackend(GDNAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "GDN_ATTN"

    @staticmethod
    def get_builder_cls() -> type[AtomGDNAttentionMetadataBuilder]:
        return AtomGDNAttentionMetadataBuilder
