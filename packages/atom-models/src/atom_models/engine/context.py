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
    state_indices: torch.Tensor  # [Np] int32: recurrent-state slot (slot 0 of each sequence's group)
    has_initial_state: torch.Tensor  # [Np] bool
    conv_indices: torch.Tensor  # [Np] int32: conv-state row (the sequence's group id)


@dataclass(frozen=True)
class GDNDecodeGroup:
    """``num_seqs`` sequences of ``q_len`` tokens each (decode: 1, verify: 1 + k), contiguous from ``start``."""

    start: int
    num_seqs: int
    q_len: int
    state_indices: torch.Tensor  # [N, q_len] int32: slot of the state after each token
    conv_indices: torch.Tensor  # [N] int32: conv-state row (the sequence's group id)
    num_accepted: torch.Tensor  # [N] int32: tokens accepted in the sequence's previous step


@dataclass(frozen=True)
class StepContext:
    attn: AttentionMeta
    gdn_prefill: GDNPrefill | None = None
    gdn_decode: tuple[GDNDecodeGroup, ...] = ()
