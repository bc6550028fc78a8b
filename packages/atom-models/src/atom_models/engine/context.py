"""The typed per-forward batch description (``ctx``) the engine passes to its cores."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMeta:
    """Paged attention over a flat varlen batch (any mix of prefill, decode and verify sequences)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [N, max_blocks] int32
    seq_lens: torch.Tensor  # [N] int32: tokens in cache after this forward (prefix + new)
    query_start_loc: torch.Tensor  # [N + 1] int32


@dataclass(frozen=True)
class GDNPrefill:
    """The first ``num_tokens`` tokens of the batch: whole prompts, varlen, chunked delta rule."""

    num_tokens: int
    cu_seqlens: torch.Tensor  # [Np + 1] int32
    state_indices: torch.Tensor  # [Np] int32: the sequence's GDN slot (conv row and recurrent state)
    has_initial_state: torch.Tensor  # [Np] bool


@dataclass(frozen=True)
class GDNDecodeGroup:
    """``num_seqs`` sequences of ``q_len`` tokens each, contiguous from ``start``.

    ``num_commit is None``: plain decodes (q_len 1, no MTP for these requests) through
    ``gated_delta_rule_recurrent``, which updates the slot's state in place. Otherwise verifications (the
    pending token plus the drafts) through ``gated_delta_rule_verify``: it first commits ``num_commit[n]``
    tokens stashed in the slot's pending row by the previous verify step, then verifies these tokens
    without storing their states and stashes them.
    """

    start: int
    num_seqs: int
    q_len: int
    state_indices: torch.Tensor  # [N] int32: the sequence's GDN slot (conv row and recurrent state)
    num_accepted: torch.Tensor  # [N] int32 >= 1: conv history offset (tokens accepted in the previous step)
    num_commit: torch.Tensor | None = None  # [N] int32: pending tokens to commit (0 right after a prefill)


@dataclass(frozen=True)
class StepContext:
    attn: AttentionMeta
    gdn_prefill: GDNPrefill | None = None
    gdn_decode: tuple[GDNDecodeGroup, ...] = ()
