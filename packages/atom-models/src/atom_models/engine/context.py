"""The typed per-forward batch description (``ctx``) the engine passes to its cores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom_models.gdn_meta import GDNStepMeta


@dataclass(frozen=True)
class AttentionMeta:
    """Paged attention over a flat varlen batch (any mix of prefill, decode and verify sequences)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [N, max_blocks] int32
    seq_lens: torch.Tensor  # [N] int32: tokens in cache after this forward (prefix + new)
    query_start_loc: torch.Tensor  # [N + 1] int32


@dataclass(frozen=True)
class StepContext:
    """``attn`` for the attention cores; ``gdn`` (the GDN pipeline's per-step record) for the GDN cores
    (None in forwards without GDN layers, such as the MTP draft's)."""

    attn: AttentionMeta
    gdn: GDNStepMeta | None = None
