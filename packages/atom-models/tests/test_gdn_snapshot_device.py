"""The batched device plan (``atom_models.gdn_snapshot_device``) equals the host plan of
``atom_models.gdn_snapshot.plan_block_snapshots`` on every request of an exhaustive grid, and reads no
tensor value on the host (it runs on the meta device, which has no values, and traces into one graph)."""

from __future__ import annotations

import itertools

import pytest
import torch
from atom_models.gdn_snapshot import plan_block_snapshots
from atom_models.gdn_snapshot_device import NO_COPY, plan_block_snapshots_batch


def _grid(block_size: int):
    """Every (computed 0..40, scheduled 1..5, is_verify, prev_col) the host plan accepts: -1 for a new
    request, else any column from 0 to a column past the furthest block a step of 5 tokens reaches."""
    for computed, scheduled, is_verify in itertools.product(range(41), range(1, 6), (False, True)):
        cols = [-1] if computed == 0 else range(0, (computed + 5) // block_size + 2)
        for prev in cols:
            yield computed, scheduled, prev, is_verify


def _pairs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int]]:
    out = []
    for s, d in zip(src.tolist(), dst.tolist()):
        assert (s == NO_COPY) == (d == NO_COPY), "a copy slot has a source without a destination"
        if s != NO_COPY:
            out.append((s, d))
    return out


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_batch_plan_equals_the_host_plan_on_a_grid(block_size):
    rows = list(_grid(block_size))
    computed, scheduled, prev, verify = (torch.tensor(c) for c in zip(*rows))
    plan = plan_block_snapshots_batch(computed, scheduled, prev, verify.bool(), block_size)
    n = len(rows)
    assert plan.state_col.shape == (n,) and plan.before_src.shape == (n, 2) and plan.after_dst.shape == (n,)
    assert all(t.dtype == torch.int64 for t in (plan.state_col, plan.before_src, plan.after_src))
    seen_after = seen_two_before = 0
    for i, (c, s, p, v) in enumerate(rows):
        host = plan_block_snapshots(computed=c, scheduled=s, block_size=block_size, prev_col=p, is_verify=v)
        where = f"computed={c} scheduled={s} prev_col={p} is_verify={v}"
        assert int(plan.state_col[i]) == host.state_col, where
        assert _pairs(plan.before_src[i], plan.before_dst[i]) == host.before, where
        assert _pairs(plan.after_src[i : i + 1], plan.after_dst[i : i + 1]) == host.after, where
        seen_after += bool(host.after)
        seen_two_before += len(host.before) == 2
    assert seen_after > 0 and seen_two_before > 0, "the grid must reach every kind of copy"


def test_batch_plan_of_int32_inputs_and_an_empty_batch():
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    plan = plan_block_snapshots_batch(i32(15, 32), i32(4, 5), i32(0, 1), torch.tensor([True, False]), 16)
    assert plan.state_col.tolist() == [1, 2]
    assert plan.before_src.tolist() == [[0, -1], [1, -1]] and plan.before_dst.tolist() == [[1, -1], [2, -1]]
    assert plan.after_src.tolist() == [1, -1] and plan.after_dst.tolist() == [0, -1]
    empty = plan_block_snapshots_batch(i32(), i32(), i32(), torch.zeros(0, dtype=torch.bool), 16)
    assert empty.state_col.shape == (0,) and empty.before_src.shape == (0, 2)
    with pytest.raises(ValueError, match="block_size"):
        plan_block_snapshots_batch(i32(1), i32(1), i32(0), torch.tensor([True]), 0)


def test_batch_plan_reads_no_values_on_the_host():
    # the meta device has shapes but no values: any .item() / .tolist() / nonzero / bool() of a tensor fails
    meta = [torch.zeros(7, dtype=torch.int64, device="meta") for _ in range(3)]
    plan = plan_block_snapshots_batch(*meta, torch.zeros(7, dtype=torch.bool, device="meta"), 16)
    assert plan.before_dst.shape == (7, 2) and plan.after_src.device.type == "meta"
    # one graph without breaks: a data-dependent host read would break it
    traced = torch.compile(plan_block_snapshots_batch, fullgraph=True, backend="eager", dynamic=True)
    args = (
        torch.tensor([15, 16]),
        torch.tensor([4, 4]),
        torch.tensor([0, 1]),
        torch.tensor([True, True]),
        16,
    )
    got, want = traced(*args), plan_block_snapshots_batch(*args)
    for a, b in zip(vars(got).values(), vars(want).values()):
        assert torch.equal(a, b)
