"""Prefix caching for the GDN state: vLLM's Mamba "align" blocks filled with atom-models' snapshots.

With prefix caching vLLM keeps one Mamba block per ``block_size`` tokens in a request's block-table row
(``mamba_cache_mode == "align"``), hashes a full block like an attention block and hands it to a later
request with the same prefix as the state after that prefix. ATOM's GDN state is a deferred-commit
snapshot (``atom_models.gdn_snapshot``): the slot of a request holds the committed state, the pending tokens
of its last verify and their position, which is valid for a range of prefix lengths. Per step and request,
:func:`plan_step_copies` maps atom-models' :func:`~atom_models.gdn_snapshot.plan_block_snapshots` (in
block-table columns) onto the request's block ids: move the state into the step's block, and keep the block
that vLLM is about to share valid at its boundary.

The copies run at step level, where vLLM's V1 runner copies Mamba states (``patches.mamba_align``; Model
Runner V2 plans the same copies on the device, ``layers.gdn_align_state``): the
"before" copies of a step before its forward, the "after" copies once the forward has run (vLLM's
postprocess after sampling), each as one upload of the step's pairs and one ``copy_rows`` call for all GDN
layers of a group (:func:`run_copies` with the group's :class:`~atom_models.gdn_snapshot.SlotCopier`, built
once per group by the model's :class:`SnapshotSchedule`): no host work per pair or per layer and none inside
the forward. The forward of a decode or verify batch therefore has no snapshot work at all, and vLLM may
capture it in a full CUDA graph as without prefix caching. Between the two points the "after" copies wait
on the model's :class:`SnapshotSchedule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from atom_models.gdn_snapshot import SlotCopier, plan_block_snapshots

from atom_vllm_plugin.layers.host_copy import to_device

NULL_BLOCK = 0  # vLLM's null block id (vllm.v1.attention.backends.utils.NULL_BLOCK_ID): never a state


@dataclass(frozen=True)
class StepCopies:
    """One KV-cache group's whole-slot copies for one step, as block ids (int64 arrays of equal length
    per pair)."""

    before_src: np.ndarray
    before_dst: np.ndarray
    after_src: np.ndarray
    after_dst: np.ndarray

    @property
    def empty(self) -> bool:
        return self.before_src.size == 0 and self.after_src.size == 0


@dataclass(frozen=True)
class RequestStep:
    """What the plan needs of one request in one step: tokens computed before it, tokens scheduled (drafts
    included), the column of its previous state block (-1: none), whether it verifies drafts."""

    computed: int
    scheduled: int
    prev_col: int
    is_verify: bool


def plan_step_copies(
    steps: Sequence[RequestStep], block_ids: Sequence[Sequence[Sequence[int]]], block_size: int
) -> tuple[list[int], list[StepCopies]]:
    """The state column of every request and each group's copies.

    ``block_ids[g][i]``: request ``i``'s block-table row in Mamba group ``g``. Copies into the null block or
    onto their own source are dropped (vLLM never shares a null block; an unmoved state needs no copy).
    """
    cols: list[int] = []
    pairs_before: list[tuple[int, int]] = []  # (request, src col, dst col) flattened below
    pairs_after: list[tuple[int, int]] = []
    rows_before: list[int] = []
    rows_after: list[int] = []
    for i, st in enumerate(steps):
        plan = plan_block_snapshots(
            computed=st.computed,
            scheduled=st.scheduled,
            block_size=block_size,
            prev_col=st.prev_col,
            is_verify=st.is_verify,
        )
        cols.append(plan.state_col)
        pairs_before += plan.before
        rows_before += [i] * len(plan.before)
        pairs_after += plan.after
        rows_after += [i] * len(plan.after)
    groups = []
    for rows_of_group in block_ids:
        before = _resolve(rows_of_group, rows_before, pairs_before)
        after = _resolve(rows_of_group, rows_after, pairs_after)
        groups.append(StepCopies(before[0], before[1], after[0], after[1]))
    return cols, groups


def _resolve(
    rows: Sequence[Sequence[int]], req: list[int], pairs: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    src, dst = [], []
    for r, (s_col, d_col) in zip(req, pairs):
        row = rows[r]
        if max(s_col, d_col) >= len(row):
            raise ValueError(
                f"GDN snapshot copy between block-table columns {s_col} -> {d_col} of a request with "
                f"{len(row)} Mamba blocks: vLLM's align-mode block table is shorter than its state column"
            )
        s, d = row[s_col], row[d_col]
        if d == NULL_BLOCK or s == d:
            continue
        if s == NULL_BLOCK:
            raise ValueError(
                f"GDN snapshot copy from block-table column {s_col}, which holds the null block: the "
                "request's previous state block was freed"
            )
        src.append(s)
        dst.append(d)
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)


def run_copies(copier: SlotCopier, src: np.ndarray, dst: np.ndarray) -> None:
    """``state[dst[i]] = state[src[i]]`` (every tensor of the slot) in each GDN layer of ``copier``'s group.

    The block ids go to the device in one upload (``[2, n]``), then one ``copy_rows`` call copies every
    layer's state tensors (one kernel launch on a GPU). Nothing to copy: nothing runs."""
    if src.size == 0:
        return
    pairs = to_device(np.stack([src, dst]).astype(np.int64, copy=False), copier.rows.device)
    copier.copy(pairs[0], pairs[1])


class SnapshotSchedule:
    """The "after" copies of the step that is running, per Mamba KV-cache group: deferred by the runner
    side before the forward, taken (once) after it. One per model, shared by its GDN cores; keyed by every
    layer name of the group."""

    def __init__(self) -> None:
        self._copies: dict[str, StepCopies] = {}
        # group's layer names -> (the cores' bound state tuples it was built from, its copier)
        self._copiers: dict[tuple[str, ...], tuple[tuple[Any, ...], SlotCopier]] = {}

    def copier(self, layer_names: Sequence[str], cores: Sequence[Any]) -> SlotCopier:
        """The :class:`SlotCopier` of the group of ``layer_names`` (``cores``: its GDN cores, in that order),
        built on first use and again only if vLLM has bound other state tensors to a core since."""
        key = tuple(layer_names)
        bound = tuple(core.kv_cache for core in cores)
        held = self._copiers.get(key)
        if held is None or len(held[0]) != len(bound) or any(a is not b for a, b in zip(held[0], bound)):
            copier = SlotCopier(cores[0].kernels, [core.layer_state() for core in cores], key)
            held = (bound, copier)
            self._copiers[key] = held
        return held[1]

    def publish(self, layer_names: Sequence[str], copies: StepCopies) -> None:
        for name in layer_names:
            self._copies[name] = copies

    def take(self, layer_names: Sequence[str]) -> StepCopies | None:
        """The copies published for the group of ``layer_names`` (withdrawn for all of them), or None."""
        found = None
        for name in layer_names:
            c = self._copies.pop(name, None)
            found = found if found is not None else c
        return found
