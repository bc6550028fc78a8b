"""GDN state snapshots (``atom_models.gdn_snapshot``): the block-boundary copy plan, whole-slot copies,
``pending_pos`` bookkeeping, and resuming a prompt chunk from a deferred-commit snapshot.

The numeric test is the contract a prefix cache relies on: a slot copied after a verify step is the state
after every prefix length ``L`` its accepted pending tokens cover; a chunk resumed from it at ``L`` gives
the outputs of the dense pipeline over the whole sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _helpers import K_SPEC, gdn_state
from atom_kernels import select_kernels
from atom_models.dense_cores import DenseContext, DenseGDNCore
from atom_models.gdn_meta import GDNPrefillMeta, GDNSnapshotMeta, GDNStepMeta, GDNVerifyMeta
from atom_models.gdn_pipeline import gdn_forward
from atom_models.gdn_snapshot import SnapshotPlan, plan_block_snapshots, put_positions
from atom_models.gdn_state import GDNGeometry
from atom_models.testing import copy_slots, paged_gdn_states, random_gdn_layer, tiny_config

# float32 reference kernels, resumed chunk vs dense chunked pipeline over the whole sequence: measured
# max |error| about 1e-6 (recurrent / verify commit vs chunked summation order)
ATOL = 1e-4


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def _plan(**kw) -> SnapshotPlan:
    return plan_block_snapshots(block_size=16, **kw)


def test_plan_moves_the_state_and_fills_the_boundary_block():
    # prompt chunk ending on a boundary computes in that block: nothing else to do
    assert _plan(computed=0, scheduled=16, prev_col=-1, is_verify=False) == SnapshotPlan(0)
    # next step of that request: move from block 0 into block 1, block 0 already holds the boundary state
    assert _plan(computed=16, scheduled=4, prev_col=0, is_verify=True) == SnapshotPlan(1, [(0, 1)])
    # a verify from 15 (k = 3) reaches the boundary 16 with its first token: snapshot after the step
    assert _plan(computed=15, scheduled=4, prev_col=0, is_verify=True) == SnapshotPlan(1, [(0, 1)], [(1, 0)])
    # previous verify started at 13 and ran into block 1 (13 + 4 > 16); 3 accepted: computed == 16, the
    # state the step starts from (in block 1) is the boundary state: copy it into block 0 first
    assert _plan(computed=16, scheduled=4, prev_col=1, is_verify=True) == SnapshotPlan(1, [(1, 0)])
    # same, 2 accepted (computed 15): the verify's own snapshot goes to block 0 afterwards
    assert _plan(computed=15, scheduled=4, prev_col=1, is_verify=True) == SnapshotPlan(1, [], [(1, 0)])
    # a one-token prompt row reaching the boundary computes in block 0 itself
    assert _plan(computed=15, scheduled=1, prev_col=0, is_verify=False) == SnapshotPlan(0)
    # a prefix hit of 32 tokens (block 1 shared): copy into the chunk's block, never write the shared one
    assert _plan(computed=32, scheduled=5, prev_col=1, is_verify=False) == SnapshotPlan(2, [(1, 2)])


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"computed": 3, "scheduled": 1, "prev_col": -1, "is_verify": True}, "has a state column"),
        ({"computed": 0, "scheduled": 0, "prev_col": -1, "is_verify": False}, "scheduled >= 1"),
    ],
)
def test_plan_rejects_inconsistent_requests(kw, match):
    with pytest.raises(ValueError, match=match):
        _plan(**kw)


def test_copy_slots_moves_every_tensor_and_positions_skip_padding():
    geo = GDNGeometry.from_config(tiny_config(), K_SPEC)
    st = gdn_state(geo, 5)
    for i, t in enumerate(st.tensors()):
        t.copy_(torch.arange(t.numel()).view(t.shape).to(t.dtype) + i)
    before = [t.clone() for t in st.tensors()]
    copy_slots(st, torch.tensor([3, 1]), torch.tensor([0, 4]))
    for b, t in zip(before, st.tensors()):
        assert torch.equal(t[0], b[3]) and torch.equal(t[4], b[1]) and torch.equal(t[1:4], b[1:4])
    put_positions(st.pending_pos, _i32([2, -1, 4]), _i32([70, 99, 80]))
    assert st.pending_pos.view(-1)[[2, 4]].tolist() == [70, 80]
    keep = st.pending_pos.clone()
    put_positions(st.pending_pos, _i32([-1, -1]), _i32([5, 6]))  # padding only: nothing changes
    assert torch.equal(st.pending_pos, keep)
    two, three, none = (torch.zeros(n, dtype=torch.long) for n in (2, 3, 0))
    with pytest.raises(ValueError, match="must be equal 1-D"):
        GDNSnapshotMeta(two, three, none, none)


@pytest.mark.parametrize("resume_at", [9, 10])
def test_a_chunk_resumed_from_a_verify_snapshot_matches_the_dense_pipeline(resume_at):
    """Prefill 8 tokens, verify 3 (k = 2) of which 2 are kept; copy the slot (the "shared block"), resume a
    4-token chunk from it at L = 9 or 10 in another slot: outputs equal the dense pipeline over L + 4
    tokens, and the shared slot is untouched."""
    torch.manual_seed(0)
    cfg = tiny_config()
    kern = select_kernels("cpu", torch.float32, backend="reference")
    layer = random_gdn_layer(cfg, kern)
    geo = GDNGeometry.from_config(cfg, K_SPEC)
    st = gdn_state(geo, 4)
    st.pending.fill_(3.0)  # stale contents the prefill must neutralise
    w = layer.gdn_weights()
    n = resume_at + 4
    x, b, a = torch.randn(n, geo.conv_dim), torch.randn(n, geo.num_v_heads), torch.randn(n, geo.num_v_heads)

    def run(rows, step):
        return gdn_forward(kern, geo, w, st, x[rows], b[rows], a[rows], step)

    no = torch.zeros(1, dtype=torch.bool)
    pre = GDNPrefillMeta(1, 8, _i32([0, 8]), _i32([1]), no, context_lens=_i32([0]))
    run(slice(0, 8), GDNStepMeta(prefill=pre))
    assert st.pending_pos[1].item() == 7
    ver = GDNVerifyMeta(1, 3, _i32([1]), _i32([1]))
    run(slice(8, 11), GDNStepMeta(verifies=(ver,)))
    assert st.pending_pos[1].item() == 8
    # the shared block: a whole-slot copy of the verify's snapshot (slot 1 -> 2)
    copy_slots(st, torch.tensor([1]), torch.tensor([2]))
    shared = [t[2].clone() for t in st.tensors()]
    # resume in slot 3 from the shared slot 2, copied before the step as for a prefix hit
    none = torch.zeros(0, dtype=torch.long)
    hit = GDNSnapshotMeta(torch.tensor([2]), torch.tensor([3]), none, none)
    resumed = GDNPrefillMeta(
        1,
        4,
        _i32([0, 4]),
        _i32([3]),
        torch.ones(1, dtype=torch.bool),
        context_lens=_i32([resume_at]),
        resume_pending=True,
    )
    out = run(slice(resume_at, n), GDNStepMeta(prefill=resumed, snapshots=hit))
    ref = DenseGDNCore(cfg, kern)(x, b, a, w, DenseContext((n,)))[resume_at:]
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert st.pending_pos[3].item() == n - 1
    assert all(torch.equal(s, t[2]) for s, t in zip(shared, st.tensors())), "the shared slot was written"


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("k", [0, K_SPEC])
def test_slot_copier_equals_per_layer_copy_slots(backend, k):
    """One copier over several layers' page-strided states, fed fixed-size indices padded with -1 (and a
    pair onto itself), leaves every pool byte as per-layer ``copy_slots`` of the real pairs does."""
    from atom_kernels import registry
    from atom_models.gdn_snapshot import SlotCopier

    if backend not in registry.available_backends("copy_rows", torch.device("cpu"), torch.float32):
        pytest.skip(f"the {backend} backend does not run on CPU here (triton: TRITON_INTERPRET=1)")
    geo = GDNGeometry.from_config(tiny_config(), k)
    (ours, our_pools), (theirs, their_pools) = (
        paged_gdn_states(geo, 3, 7, generator=torch.Generator().manual_seed(k), pad_bytes=48)
        for _ in range(2)
    )
    fn = registry.resolve("copy_rows", torch.device("cpu"), torch.float32, backend).fn
    kern = dataclasses.replace(select_kernels("cpu", torch.float32), copy_rows=fn)
    copier = SlotCopier(kern, ours, [f"L{i}" for i in range(3)])
    assert copier.rows.names[1] == "ssm of L0" and copier.num_states == 3
    src = torch.tensor([2, -1, 5, 6, -1, -1, 1, -1])
    dst = torch.tensor([0, 3, 5, 4, -1, -1, 3, -1])
    copier.copy(src, dst)
    for st in theirs:
        copy_slots(st, torch.tensor([2, 6, 1]), torch.tensor([0, 4, 3]))
    for i, (a, b) in enumerate(zip(our_pools, their_pools)):
        assert torch.equal(a, b), f"layer {i}"
    before = [p.clone() for p in our_pools]
    copier.copy(src[:0], dst[:0])  # n = 0: nothing
    assert all(torch.equal(a, b) for a, b in zip(before, our_pools))


def test_slot_copier_rejects_states_it_cannot_copy():
    from atom_models.gdn_snapshot import SlotCopier

    geo = GDNGeometry.from_config(tiny_config(), K_SPEC)
    kern = select_kernels("cpu", torch.float32)
    st = gdn_state(geo, 4)
    with pytest.raises(ValueError, match="no GDN layer states"):
        SlotCopier(kern, [])
    with pytest.raises(ValueError, match="1 names for 2 states"):
        SlotCopier(kern, [st, st], ["a"])
    bad = type(st)(conv=st.conv[:, :, :1], ssm=st.ssm)  # conv rows with a gap: not one block of memory
    with pytest.raises(ValueError, match="the rows of conv of layer 7 .* are not dense"):
        SlotCopier(kern, [bad], ["layer 7"])
