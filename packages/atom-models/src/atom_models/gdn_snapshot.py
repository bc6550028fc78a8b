"""GDN state snapshots at block boundaries: what a prefix cache of a hybrid model shares between requests.

A prefix cache keeps, for a prefix of ``L`` tokens (``L`` a multiple of the cache's block size), the GDN
state after exactly those ``L`` tokens in one slot ("block"), which a later request with the same prefix
copies and continues from. With deferred-commit verification (``gated_delta_rule_verify``) a slot does not
always hold a finished state: it holds the committed state plus the pending tokens of the last verify, of
which only the accepted ones are ever committed. A slot is nevertheless a *snapshot* of a well-defined
range of states, because it records ``pending_pos`` (``GDNLayerState``), the sequence position of pending
token 0:

    committing ``a = L - pending_pos`` pending tokens (and reading the conv history at column ``a - 1``)
    gives the state after the first ``L`` tokens, for every ``L`` whose tokens the slot's pending tokens
    hold and the sequence kept (``1 <= a <= accepted``).

After a prompt chunk ending at ``e`` a slot holds the exact state with an identity token as pending token
0 and ``pending_pos = e - 1`` (valid for ``L = e``); after a verify of ``1 + k`` tokens starting at ``c`` it
holds ``pending_pos = c`` (valid for ``L = c + 1 .. c + accepted``, where ``L = c + 1`` is always valid:
token ``c`` is the verified one, never a draft). Whole-slot copies preserve the snapshot.

This module has three parts:

- :func:`plan_block_snapshots` (host, per request and step): which whole-slot copies keep a slot that the
  cache is about to share valid at its block's boundary, given where the request's state lives;
- :class:`SlotCopier` (device): the copies of a whole model's GDN layers, every state tensor of the listed
  slots, in one ``copy_rows`` call (one launch on a GPU, padded pairs masked on the device, capturable);
- :func:`resume_pending` and :func:`put_positions` (device): a prompt chunk starting from a snapshot
  commits its ``context_len - pending_pos`` pending tokens first, and every part records ``pending_pos``.

Without speculative decoding there are no pending tokens: a slot holds the exact state after its last
step, and the plan reduces to moving a request's state to a new slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from atom_kernels.ops.copy_rows import RowTable

from atom_models.gdn_meta import GDNWeights
from atom_models.gdn_state import GDNGeometry, GDNLayerState


@dataclass
class SnapshotPlan:
    """Whole-slot copies of one request for one step, as column indices of its block-table row.

    ``before``: ``(src, dst)`` pairs to copy before the step; ``after``: pairs to copy after it.
    ``state_col``: the column whose slot the step computes in."""

    state_col: int
    before: list[tuple[int, int]] = field(default_factory=list)
    after: list[tuple[int, int]] = field(default_factory=list)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_block_snapshots(
    *, computed: int, scheduled: int, block_size: int, prev_col: int, is_verify: bool
) -> SnapshotPlan:
    """Where one request's step computes and which slots it copies, in block-table columns.

    Contract (a block-aligned prefix cache, as vLLM's Mamba "align" mode): the block-table row of a request
    has one column per ``block_size`` tokens; the step computes in the column of its last scheduled token
    (``ceil((computed + scheduled) / block_size) - 1``, drafts included); the state the step starts from
    lives in ``prev_col`` (the previous step's column, or the column of a prefix-cache hit; -1: none,
    ``computed == 0``). The cache shares column ``i`` as the state after ``L = (i + 1) * block_size`` tokens
    once the sequence's known tokens reach ``L`` (``computed + 1 >= L`` during decoding), from the next
    step on, while the column's slot still belongs to the request (``computed <= L``).

    So at a step with ``L = (computed + 1) // block_size * block_size`` in ``{computed, computed + 1}``,
    the boundary column ``L / block_size - 1`` must hold a snapshot valid at ``L``:

    - ``L == computed``: the state the step starts from is that state: copy ``prev_col`` there before;
    - ``L == computed + 1`` and a verify: the verify's own snapshot (``pending_pos = computed``) is valid
      at ``computed + 1``: copy the step's column there after the step. A prompt chunk ending at ``L``
      computes in that column itself.
    """
    if computed < 0 or scheduled < 1 or block_size < 1:
        raise ValueError(
            f"plan_block_snapshots: computed={computed}, scheduled={scheduled}, block_size={block_size}: "
            "need computed >= 0, scheduled >= 1, block_size >= 1"
        )
    if (prev_col < 0) != (computed == 0):
        raise ValueError(
            f"plan_block_snapshots: prev_col={prev_col} with computed={computed}: a request with computed "
            "tokens has a state column, a new one has none"
        )
    curr = _cdiv(computed + scheduled, block_size) - 1
    plan = SnapshotPlan(state_col=curr)
    if prev_col < 0:
        return plan
    if prev_col != curr:
        plan.before.append((prev_col, curr))
    boundary = (computed + 1) // block_size * block_size
    if boundary == 0:
        return plan
    col = boundary // block_size - 1
    if col == curr:
        return plan
    if boundary == computed and col != prev_col:
        plan.before.append((prev_col, col))
    elif boundary == computed + 1 and is_verify:
        plan.after.append((curr, col))
    return plan


STATE_TENSOR_NAMES = ("conv", "ssm", "pending", "pending_pos")  # GDNLayerState.tensors() order


class SlotCopier:
    """Whole-slot copies for a fixed set of GDN layer states (e.g. every GDN layer of a model), all layers
    and state tensors in one ``kernels.copy_rows`` call.

    Built once for states whose tensors do not change afterwards (it keeps their addresses: a
    :class:`~atom_kernels.ops.copy_rows.RowTable`); every state's rows must be dense blocks (vLLM's
    page-strided views and the transposed conv view are). ``names`` (one per state, e.g. layer names) label
    errors.
    """

    def __init__(self, kernels, states: Sequence[GDNLayerState], names: Sequence[str] | None = None) -> None:
        states = tuple(states)
        if not states:
            raise ValueError("SlotCopier: no GDN layer states")
        labels = tuple(names) if names is not None else tuple(f"GDN layer {i}" for i in range(len(states)))
        if len(labels) != len(states):
            raise ValueError(f"SlotCopier: {len(labels)} names for {len(states)} states")
        tensors, tensor_names = [], []
        for state, label in zip(states, labels):
            for t, what in zip(state.tensors(), STATE_TENSOR_NAMES):
                tensors.append(t)
                tensor_names.append(f"{what} of {label}")
        self.num_states = len(states)
        self.rows = RowTable.build(tensors, tensor_names)
        self._copy_rows = kernels.copy_rows

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``state[dst[i]] = state[src[i]]`` for every state and tensor; ``src`` / ``dst``: ``[n]`` int64 on
        the states' device. Pairs with a negative index or ``src == dst`` copy nothing (fixed-size index
        tensors padded with -1 are fine); no destination may repeat or be another pair's source. On a GPU
        (triton backend) one launch, no host synchronisation: capturable."""
        self._copy_rows(self.rows, src, dst)


def put_positions(pending_pos: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``pending_pos[slots[i]] = values[i]`` for every real slot (``slots[i] >= 0``); padding rows change
    nothing. ``pending_pos``: ``[S, 1]`` int32; ``slots``, ``values``: ``[N]``. Device ops only: padding
    rows take part in an ``amax`` scatter with the lowest value (or, in a batch of padding only, slot 0's
    own value), which never wins over a real row's."""
    if slots.numel() == 0:
        return
    flat = pending_pos.view(-1)
    valid = slots >= 0
    top = slots.max()
    target = torch.where(valid, slots, top.clamp(min=0)).long()
    low = torch.full_like(flat[target], torch.iinfo(flat.dtype).min)
    filler = torch.where(top < 0, flat[target], low)
    flat.scatter_reduce_(
        0, target, torch.where(valid, values.to(flat.dtype), filler), "amax", include_self=False
    )


def resume_pending(
    kernels,
    geometry: GDNGeometry,
    weights: GDNWeights,
    state: GDNLayerState,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Turn the snapshots of the sequences that continue from a state into their exact state after
    ``context_lens`` tokens: commit ``a = context_len - pending_pos`` pending tokens into ``ssm`` and move
    the conv history read at column ``a - 1`` to column 0 (where a prompt chunk reads it).

    The commit is the verify op's own (``num_commit = a``), run on one placeholder token whose output and
    stashed pending row are discarded (the chunk that follows resets ``pending[s, 0]``), so a resumed state
    is computed exactly as the verify that follows a step would. ``slots``, ``has_initial_state``,
    ``context_lens``: ``[N]`` for the chunk's sequences; rows without an initial state are left alone.
    """
    if state.pending is None or state.pending_pos is None:
        return
    n = slots.shape[0]
    if n == 0:
        return
    use = has_initial_state & (slots >= 0)
    rows = torch.where(use, slots, -1).to(torch.int32)
    safe = rows.clamp(min=0).long()  # rows without an initial state read slot 0's position, then commit 0
    r = state.pending.shape[1]
    commit = (context_lens.long() - state.pending_pos.view(-1)[safe].long()).clamp(0, r)
    commit = torch.where(use, commit, 0).to(torch.int32)
    geo, dt = geometry, weights.conv_weight.dtype
    ones_k = torch.ones(n, 1, geo.num_k_heads, geo.head_k_dim, dtype=dt, device=slots.device)
    zeros_v = torch.zeros(n, 1, geo.num_v_heads, geo.head_v_dim, dtype=dt, device=slots.device)
    zeros_g = torch.zeros(n, 1, geo.num_v_heads, dtype=dt, device=slots.device)
    kernels.gated_delta_rule_verify(
        ones_k,
        ones_k,
        zeros_v,
        zeros_g,
        zeros_g,
        state.ssm,
        state.pending,
        rows,
        commit,
        scale=geometry.scale,
        use_qk_l2norm=True,
        A_log=weights.A_log,
        dt_bias=weights.dt_bias,
    )
    # conv history: columns [a - 1, a - 1 + K - 1) -> [0, K - 1) (a = 0 or 1: unchanged). Rows without an
    # initial state write their own slot's history back; padding rows (slot < 0) write slot 0's back, so
    # slot 0 must not be a resumed sequence's slot in a chunk with padding rows (vLLM's null block never is).
    hist = geometry.conv_kernel - 1
    offset = (commit.long() - 1).clamp(min=0)
    cols = offset[:, None] + torch.arange(hist, device=slots.device)[None, :]
    target = slots.clamp(min=0).long()
    conv = state.conv[target]  # [N, C, W] (a copy)
    moved = torch.gather(conv, 2, cols[:, None, :].expand(n, conv.shape[1], hist))
    conv[:, :, :hist] = torch.where(use[:, None, None], moved, conv[:, :, :hist])
    state.conv[target] = conv
