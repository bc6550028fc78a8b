"""Prefix caching for the GDN state, planned on the device: the bookkeeping of vLLM's Mamba "align" mode
for a runner that keeps its requests' token counts on the device (vLLM's Model Runner V2).

The contract is :func:`atom_models.gdn_snapshot.plan_block_snapshots` (which block-table column a step
computes in, which whole-slot copies keep the blocks that vLLM shares valid at their boundaries). Under
Model Runner V2 the host knows a request's computed tokens only optimistically (drafts it has not yet
seen rejected), the device knows them exactly; so :class:`AlignSnapshots` plans every step on the device
(:func:`atom_models.gdn_snapshot_device.plan_block_snapshots_batch`), keeps each request's state column
there (per request-state index, seeded when a request is added, as vLLM does), maps columns to block ids
through the device block tables of each Mamba KV-cache group (:func:`block_pairs`), and runs the copies
(:class:`atom_models.gdn_snapshot.SlotCopier`: every GDN layer of a group in one ``copy_rows`` call, padded
pairs skipped on the device): those due before the step at once, those due after it from persistent
buffers once the step has sampled. Nothing reads a device value on the host.

A copy into the null block (vLLM skipped that block's state) or onto itself is no copy. A copy from the
null block into a real one, or between columns outside the block-table row, would lose a request's state:
the host planner of the V1 runner (``layers.gdn_snapshots``) raises for them. A device plan cannot raise
inside the step, so it skips them and counts them on the device; :class:`AlignSnapshots` reads the count
without waiting (a non-blocking copy to pinned memory, read once the copy has completed, at the latest one
step later) and raises ``RuntimeError`` naming the count: such a state is never lost silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from atom_models.gdn_snapshot_device import NO_COPY, plan_block_snapshots_batch

NULL_BLOCK = 0  # vLLM's null block id (vllm.v1.attention.backends.utils.NULL_BLOCK_ID): never a state


class SlotCopies(Protocol):
    """Whole-slot copies in every GDN layer of one Mamba group (:class:`atom_models.gdn_snapshot.SlotCopier`):
    ``copy(src, dst)`` with ``[n]`` int64 device tensors, a pair with a negative index or ``src == dst``
    skipped on the device."""

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...


def block_pairs(
    table: torch.Tensor,
    rows: torch.Tensor,
    src_cols: torch.Tensor,
    dst_cols: torch.Tensor,
    lost: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column pairs of a plan as block-id pairs, flattened to ``[N * m]`` int64 with ``-1`` for no copy.

    ``table``: ``[R, W]`` block table (rows by request-state index); ``rows``: ``[N]`` the table row of
    each planned request; ``src_cols`` / ``dst_cols``: ``[N, m]`` columns (``-1``: no copy). A pair is
    dropped where a column is ``-1`` or ``>= W``, either block is the null block, or both are one block.
    ``lost`` (``[1]`` int64, on the device): incremented by the number of dropped pairs that would have
    carried a state (a column ``>= W``, or the null block as the source of a real destination)."""
    width = table.shape[1]
    planned = (src_cols >= 0) & (dst_cols >= 0)
    valid = planned & (src_cols < width) & (dst_cols < width)
    r = rows.long()[:, None].expand_as(src_cols)
    src = table[r, src_cols.clamp(0, width - 1)].long()
    dst = table[r, dst_cols.clamp(0, width - 1)].long()
    keep = valid & (src != NULL_BLOCK) & (dst != NULL_BLOCK) & (src != dst)
    if lost is not None:
        null_source = valid & (src == NULL_BLOCK) & (dst != NULL_BLOCK)
        lost += ((planned & ~valid) | null_source).sum()
    return torch.where(keep, src, NO_COPY).reshape(-1), torch.where(keep, dst, NO_COPY).reshape(-1)


@dataclass
class GroupSnapshots:
    """One Mamba KV-cache group: its block table (``[max_num_reqs, W]`` on the device, rows by
    request-state index, refilled in place by the runner), the copier of its GDN layers, and the persistent
    ``[max_num_reqs]`` buffers of the block pairs due after the running step."""

    table: torch.Tensor
    copier: SlotCopies
    after_src: torch.Tensor
    after_dst: torch.Tensor


class AlignSnapshots:
    """The align-mode state of a batch runner, on the device: the state column of every request-state
    index, and each Mamba group's copies of the running step.

    Per step: :meth:`before_step` (plan, record the columns, copy before the forward, stage the copies due
    after it), the forward, then :meth:`after_step`. A step whose :meth:`after_step` did not run has its
    copies run by the next :meth:`before_step` first."""

    def __init__(
        self,
        max_num_reqs: int,
        block_size: int,
        device: torch.device,
        groups: Sequence[tuple[torch.Tensor, SlotCopies]],
    ) -> None:
        if block_size < 1:
            raise ValueError(f"AlignSnapshots: block_size={block_size}, need >= 1")
        self.block_size = block_size
        self.state_col = torch.full((max_num_reqs,), NO_COPY, dtype=torch.int64, device=device)
        self.groups = [
            GroupSnapshots(
                table,
                copier,
                torch.full((max_num_reqs,), NO_COPY, dtype=torch.int64, device=device),
                torch.full((max_num_reqs,), NO_COPY, dtype=torch.int64, device=device),
            )
            for table, copier in groups
        ]
        self._after_rows = 0  # rows of the after buffers the running step filled (0: none due)
        # copies that would have lost a state (see the module docstring), counted on the device and read
        # on the host without a wait: a pinned copy, read once its event has completed
        self.lost = torch.zeros(1, dtype=torch.int64, device=device)
        on_cuda = self.lost.device.type == "cuda"
        self._lost_host = torch.zeros(1, dtype=torch.int64, pin_memory=on_cuda)
        self._lost_event = torch.cuda.Event() if on_cuda else None
        self._lost_pending = False

    def seed(self, req_index: int, num_computed_tokens: int) -> None:
        """A request added at ``req_index`` with ``num_computed_tokens`` already computed (a prefix hit, a
        resumed request): its state is in the column of its last computed token (``-1``: none)."""
        self.state_col[req_index].fill_((num_computed_tokens - 1) // self.block_size)

    def before_step(
        self,
        idx_mapping: torch.Tensor,
        num_computed_tokens: torch.Tensor,
        query_start_loc: torch.Tensor,
        is_verify: torch.Tensor,
    ) -> None:
        """Plan the step of the ``N = len(idx_mapping)`` batch rows and run the copies due before it.

        ``idx_mapping [N]``: batch row -> request-state index; ``num_computed_tokens``: per request-state
        index, tokens computed before the step; ``query_start_loc [>= N + 1]``: the rows' token offsets
        (drafts included); ``is_verify [N]`` bool: the row verifies drafts (vLLM's GDN builder runs it as a
        spec-decode row), so its slot ends as a snapshot of the step's first token."""
        self.after_step()
        self.check_lost()
        n = idx_mapping.shape[0]
        if n == 0:
            return
        rows = idx_mapping.long()
        qsl = query_start_loc[: n + 1].long()
        plan = plan_block_snapshots_batch(
            num_computed_tokens[rows], qsl[1:] - qsl[:-1], self.state_col[rows], is_verify, self.block_size
        )
        self.state_col[rows] = plan.state_col
        for g in self.groups:
            src, dst = block_pairs(g.table, rows, plan.before_src, plan.before_dst, self.lost)
            g.copier.copy(src, dst)
            src, dst = block_pairs(g.table, rows, plan.after_src[:, None], plan.after_dst[:, None], self.lost)
            g.after_src[:n].copy_(src)
            g.after_dst[:n].copy_(dst)
        self._after_rows = n
        self._stage_lost()

    def check_lost(self) -> None:
        """Raise ``RuntimeError`` if a staged count of lost copies has arrived and is not zero (no wait:
        a count still in flight is read at a later call)."""
        if not self._lost_pending or (self._lost_event is not None and not self._lost_event.query()):
            return
        self._lost_pending = False
        count = int(self._lost_host[0])
        if count:
            raise RuntimeError(
                f"prefix caching (Mamba align mode): {count} GDN state copies had no state to copy (the "
                "null block as the source of a real block, or a block-table column past the request's row); "
                "the GDN states of those requests would be wrong. vLLM's block bookkeeping and the plugin's "
                "snapshot plan (atom_models.gdn_snapshot.plan_block_snapshots) disagree; serve with "
                "--no-enable-prefix-caching until this is fixed"
            )

    def _stage_lost(self) -> None:
        if self._lost_pending:  # the previous count has not arrived yet; the device keeps accumulating
            return
        self._lost_host.copy_(self.lost, non_blocking=self._lost_event is not None)
        if self._lost_event is not None:
            self._lost_event.record()
        self._lost_pending = True

    def after_step(self) -> None:
        """Run (once) the copies the last :meth:`before_step` staged for after its forward."""
        n, self._after_rows = self._after_rows, 0
        if n == 0:
            return
        for g in self.groups:
            g.copier.copy(g.after_src[:n], g.after_dst[:n])
