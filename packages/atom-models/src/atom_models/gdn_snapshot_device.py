"""The block-snapshot plan of :func:`atom_models.gdn_snapshot.plan_block_snapshots`, for a batch, on the device.

The host plan decides per request and step which whole-slot copies keep a prefix cache's shared GDN
blocks valid; its docstring is the contract. :func:`plan_block_snapshots_batch` computes the same plan
for ``N`` requests at once from device tensors, with elementwise torch ops only: no host reads, no
data-dependent shapes. Every request has room for the host plan's largest answer (two copies before the
step, one after it); a slot without a copy holds ``-1`` in both its source and its destination.
A runner that keeps its requests' token counts on the device (so that the host knows them only
optimistically, ahead of rejected drafts) plans there without waiting for the device.

Inputs outside the host plan's domain (``computed < 0``, ``scheduled < 1``, a state column for a request
without computed tokens or none for one with them) are not checked: the host plan raises for them, a
device plan cannot. A row with ``prev_col < 0`` is planned as a new request (no copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_COPY = -1
"""Column (or block) of a copy slot that holds no copy."""


@dataclass(frozen=True)
class BatchSnapshotPlan:
    """The plan of ``N`` requests, as block-table columns (int64 device tensors).

    ``state_col [N]``: the column the step computes in. ``before_src`` / ``before_dst [N, 2]``: copies
    before the step, slot 0 the move of the state into ``state_col`` (``prev_col -> state_col``), slot 1
    the boundary copy from the state the step starts from (``prev_col -> boundary column``); their
    destinations differ and neither is a source of the request. ``after_src`` / ``after_dst [N]``: the
    copy after the step (``state_col -> boundary column``)."""

    state_col: torch.Tensor
    before_src: torch.Tensor
    before_dst: torch.Tensor
    after_src: torch.Tensor
    after_dst: torch.Tensor


def plan_block_snapshots_batch(
    computed: torch.Tensor,
    scheduled: torch.Tensor,
    prev_col: torch.Tensor,
    is_verify: torch.Tensor,
    block_size: int,
) -> BatchSnapshotPlan:
    """:func:`~atom_models.gdn_snapshot.plan_block_snapshots` for every request of a batch.

    ``computed``, ``scheduled``, ``prev_col``: ``[N]`` integer tensors (tokens computed before the step,
    tokens scheduled in it with drafts, the column of the state the step starts from or ``-1``);
    ``is_verify``: ``[N]`` bool (the step verifies drafts: its slot ends as a deferred-commit snapshot
    of the step's first token). All on one device; the result is on it too."""
    if block_size < 1:
        raise ValueError(f"plan_block_snapshots_batch: block_size={block_size}, need >= 1")
    computed = computed.long()
    prev = prev_col.long()
    end = computed + scheduled.long()
    curr = (end + (block_size - 1)) // block_size - 1
    has_prev = prev >= 0
    move = has_prev & (prev != curr)
    boundary = (computed + 1) // block_size * block_size
    col = boundary // block_size - 1
    crosses = has_prev & (boundary > 0) & (col != curr)
    keep_before = crosses & (boundary == computed) & (col != prev)
    keep_after = crosses & (boundary == computed + 1) & is_verify.bool()
    none = torch.full_like(prev, NO_COPY)
    before_src = torch.stack((torch.where(move, prev, none), torch.where(keep_before, prev, none)), dim=1)
    before_dst = torch.stack((torch.where(move, curr, none), torch.where(keep_before, col, none)), dim=1)
    return BatchSnapshotPlan(
        state_col=curr,
        before_src=before_src,
        before_dst=before_dst,
        after_src=torch.where(keep_after, curr, none),
        after_dst=torch.where(keep_after, col, none),
    )
