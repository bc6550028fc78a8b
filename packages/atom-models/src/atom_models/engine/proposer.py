"""The MTP proposer: the draft forwards of one propose, shared by the eager step and the bucketed
(graph-captured) greedy step.

A propose is a first MTP pass over rows that pair a target hidden state with the next token (for each
sequence, the hidden rows of its newly accepted positions), whose last row per sequence starts the drafting;
then per draft: the draft logits, the caller's choice of tokens (host decisions in the eager step: greedy,
sampled, decided on rank 0 under tensor parallelism; the argmax on the device in the graphed step) and,
while drafts remain, one single-row MTP step with the chosen tokens at the next position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from atom_models.engine.batch import BatchBuilder
from atom_models.engine.context import AttentionMeta, StepContext

# choose(step, logits[n, V]) -> (tokens[n] int64 on the device, rows that continue: index tensor or None
# for all of them)
Choose = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class MTPProposer:
    """Draft forwards of ``mtp`` (the MTP head) over ``builder``'s metadata (module docstring)."""

    def __init__(self, mtp, builder: BatchBuilder) -> None:
        self.mtp = mtp
        self.builder = builder

    def first_pass(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        attn: AttentionMeta,
        last: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first MTP pass over every row; returns the MTP hidden states and positions of rows ``last``
        (each sequence's last row)."""
        out = self.mtp(input_ids, positions, hidden, StepContext(attn=attn), spec_step=0)
        return out[last], positions[last]

    def draft(
        self,
        h: torch.Tensor,
        pos: torch.Tensor,
        tables: torch.Tensor,
        num_drafts: int,
        choose: Choose,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Up to ``num_drafts`` drafts per row from the first pass's ``h`` / ``pos`` (block tables
        ``tables``; rows where ``valid`` is False are padding): draft logits, ``choose``, and while drafts
        remain the next single-row MTP step over the rows ``choose`` keeps."""
        step = 0
        while True:
            tokens, keep = choose(step, self.mtp.compute_logits(h, torch.float32))
            step += 1
            if step >= num_drafts:
                return
            if keep is not None:
                if keep.numel() == 0:
                    return
                h, pos, tables, tokens = h[keep], pos[keep], tables[keep], tokens[keep]
                valid = None if valid is None else valid[keep]
            pos = pos + 1
            ctx = StepContext(attn=self.builder.decode_meta(tables, pos, valid))
            h = self.mtp(tokens, pos, h, ctx, spec_step=step)
