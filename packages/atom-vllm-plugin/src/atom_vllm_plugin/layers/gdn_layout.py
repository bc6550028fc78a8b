"""The part of one step's GDN record that every GDN KV-cache group shares: the batch layout.

vLLM splits a hybrid model's GDN layers into several KV-cache groups that differ only in their state slots.
What the GDN pipeline's record needs besides the slots (which rows are decodes, the verify part's shape and
its gather / scatter indices for ragged rows, the prompt chunks' context lengths) follows from vLLM's host
copies of the batch layout and vLLM's row counts. :func:`step_layout` reads it once per step; the builders
of every group make their records from it (``gdn_backend``), each group then adding only its own slots.

:class:`LayoutCache` keeps the layout of the step being built, for the other groups' ``build`` calls of the
same step (vLLM's align mode builds every group): an entry is reused only for the very host tensor objects
it was made from (held, so their identities cannot pass to new objects) with the same contents, so a later
step gets its own layout even where its runner refills the same host tensors in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from atom_vllm_plugin.layers.host_copy import to_device


@dataclass(frozen=True)
class DecodeLayout:
    """The ``num_rows`` one-token rows at the front of the batch. A full graph's padded batch counts its
    zero-length padding rows among them: the first ``real_rows`` rows are real and the rest padding, or,
    where padding rows are not all trailing, ``real_mask`` (device bool ``[num_rows]``) says which are."""

    num_rows: int
    real_rows: int
    real_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class VerifyLayout:
    """The spec rows as one verify part of ``q_len`` tokens per row: ``num_seqs`` real rows, ``total`` rows
    in the record (a uniform batch padded for a full graph keeps its padding rows). A uniform part's tokens
    start at ``token_start``; a ragged part has device ``gather`` / ``scatter`` indices instead."""

    num_seqs: int
    total: int
    q_len: int
    token_start: int = 0
    gather: torch.Tensor | None = None
    scatter: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillLayout:
    """The prompt chunks' tokens before this step (device int32 ``[num_prefills]``) and whether any is
    non-zero (host-known)."""

    context_lens: torch.Tensor
    resume_pending: bool


@dataclass(frozen=True)
class StepLayout:
    decode: DecodeLayout | None = None
    verify: VerifyLayout | None = None
    prefill: PrefillLayout | None = None


def has_spec_rows(md: GDNAttentionMetadata) -> bool:
    return md.spec_sequence_masks is not None and md.num_spec_decodes > 0


def _decode_layout(md: GDNAttentionMetadata, qsl: np.ndarray, device: torch.device) -> DecodeLayout:
    """Decode rows hold one token or none (padding), so ``qsl[n]`` counts the real ones, and they are the
    leading ``r`` rows exactly where ``qsl[r] == r``."""
    n = md.num_decodes
    if qsl.shape[0] <= n:  # no host row offsets for every decode row: all of them real
        return DecodeLayout(n, n)
    r = int(qsl[n] - qsl[0])
    if int(qsl[r] - qsl[0]) == r:
        return DecodeLayout(n, r)
    real = qsl[1 : n + 1] > qsl[:n]
    return DecodeLayout(n, r, to_device(real, device))


def _verify_layout(
    md: GDNAttentionMetadata, m: CommonAttentionMetadata, qsl: np.ndarray, device: torch.device
) -> VerifyLayout:
    """The spec rows (the first ``num_spec_decodes`` rows flagged in ``spec_sequence_masks_cpu``) as one
    verify part of ``Q = max(lens)`` tokens; ragged or scattered rows get gather/scatter indices.

    A uniform batch (every row ``Q`` tokens, in order from row 0, nothing else) keeps the zero-length
    padding rows of a full graph's padded batch (``m.num_actual_tokens == m.num_reqs * Q``) as verify rows
    (the record gives them slot ``PAD_SLOT`` and ``num_accepted = 1``): it then has the captured batch's shape.
    """
    n = md.num_spec_decodes
    q_uniform = md.uniform_spec_sequence_length
    if md.num_prefills == 0 and md.num_decodes == 0 and q_uniform is not None and qsl[0] == 0:
        # every spec row q_uniform tokens, every other row none: the tokens run from 0 in row order
        padded = m.num_reqs > n and m.num_actual_tokens == m.num_reqs * q_uniform
        return VerifyLayout(n, m.num_reqs if padded else n, q_uniform)
    qsl = qsl.astype(np.int64)
    mask = md.spec_sequence_masks_cpu.numpy()
    rows = np.flatnonzero(mask)[:n]
    starts = qsl[rows]
    lens = qsl[rows + 1] - starts
    q_len = max(int(lens.max()), 1)
    if (lens == q_len).all() and (starts == starts[0] + q_len * np.arange(n)).all():
        total = n
        only_verify = md.num_prefills == 0 and md.num_decodes == 0 and starts[0] == 0
        if only_verify and m.num_reqs > n and m.num_actual_tokens == m.num_reqs * q_len:
            total = m.num_reqs
        return VerifyLayout(n, total, q_len, token_start=int(starts[0]))
    col = np.arange(q_len)[None, :]
    gather = starts[:, None] + np.minimum(col, np.maximum(lens - 1, 0)[:, None])
    scatter = np.where(col < lens[:, None], starts[:, None] + col, -1)
    return VerifyLayout(
        n,
        n,
        q_len,
        gather=to_device(gather.reshape(-1), device),
        scatter=to_device(scatter.reshape(-1), device),
    )


def _prefill_context_lens(
    md: GDNAttentionMetadata, m: CommonAttentionMetadata, qsl: np.ndarray
) -> np.ndarray:
    """Tokens each prefill row had before this step (int32, in the prefill part's order): vLLM's host upper
    bound of ``seq_lens`` is exact for prefill rows. Both of vLLM's runners pass it (vLLM's own GDN builder
    requires it too); reading the device ``seq_lens`` instead would stall the step on the device."""
    qsl = qsl.astype(np.int64)
    nr = qsl.shape[0] - 1
    if m.seq_lens_cpu_upper_bound is None:
        raise ValueError(
            "GDN metadata of a prompt chunk needs CommonAttentionMetadata.seq_lens_cpu_upper_bound (the host "
            "copy of seq_lens that vLLM's model runners pass)"
        )
    seq = m.seq_lens_cpu_upper_bound[:nr].numpy().astype(np.int64)
    ctx = seq - (qsl[1:] - qsl[:-1])
    if has_spec_rows(md):
        rows = np.flatnonzero(~md.spec_sequence_masks_cpu.numpy().astype(bool)[:nr])
    else:
        rows = np.arange(md.num_decodes, md.num_decodes + md.num_prefills)
    return ctx[rows[: md.num_prefills]].astype(np.int32)


def step_layout(md: GDNAttentionMetadata, m: CommonAttentionMetadata, device: torch.device) -> StepLayout:
    """The shared part of the record of the step vLLM's ``md`` (any group's) and ``m`` describe."""
    qsl = m.query_start_loc_cpu.numpy()
    prefill = decode = verify = None
    if md.num_prefills > 0:
        context = _prefill_context_lens(md, m, qsl)
        prefill = PrefillLayout(to_device(context, device), bool((context > 0).any()))
    if md.num_decodes > 0:
        decode = _decode_layout(md, qsl, device)
    if has_spec_rows(md):
        verify = _verify_layout(md, m, qsl, device)
    return StepLayout(decode=decode, verify=verify, prefill=prefill)


def _host_key(md: GDNAttentionMetadata, m: CommonAttentionMetadata, device: torch.device) -> tuple:
    """Every host value :func:`step_layout` reads, by value, and the device it puts the layout on."""
    mask = md.spec_sequence_masks_cpu
    seq = m.seq_lens_cpu_upper_bound if md.num_prefills > 0 else None
    return (
        device,
        m.query_start_loc_cpu.numpy().tobytes(),
        None if mask is None else mask.numpy().tobytes(),
        None if seq is None else seq.numpy().tobytes(),
        m.num_reqs,
        m.num_actual_tokens,
        md.num_prefills,
        md.num_decodes,
        md.num_spec_decodes,
        md.spec_sequence_masks is None,
    )


class LayoutCache:
    """The layout of the step last built, reused by the next ``build`` only for the same step: the same
    ``query_start_loc_cpu`` and ``seq_lens_cpu_upper_bound`` tensor objects (vLLM's runners make these once
    per step and share them between the groups' common metadata) with the same contents and row counts,
    for the same device. A reused layout is the one :func:`step_layout` would make again (it reads nothing
    else, and its device tensors are never written after it is made)."""

    def __init__(self) -> None:
        self._objects: tuple = ()
        self._key: tuple | None = None
        self._layout: StepLayout | None = None

    def get(self, md: GDNAttentionMetadata, m: CommonAttentionMetadata, device: torch.device) -> StepLayout:
        objects = (m.query_start_loc_cpu, m.seq_lens_cpu_upper_bound)
        key = _host_key(md, m, device)
        same = len(self._objects) == 2 and all(a is b for a, b in zip(self._objects, objects, strict=True))
        if not (same and key == self._key and self._layout is not None):
            self._layout = step_layout(md, m, device)
            self._objects, self._key = objects, key
        return self._layout
