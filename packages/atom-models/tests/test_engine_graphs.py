"""Bucketed decode/verify steps (engine.graphs): padding to batch-size buckets over persistent buffers.

On a CPU the bucketed path runs eagerly (``EngineConfig(cuda_graphs=True)``): the same buffers, buckets
and padding rows that a GPU captures and replays. Tokens must equal the float32 greedy reference, and
padding rows must leave every slot and block they do not own untouched.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import MIN_ACCEPTANCE, float32_engine, greedy_mismatch
from atom_models.engine import EngineConfig, SamplingParams
from atom_models.engine.graphs import DecodeGraphs, bucket_sizes

SENTINEL = 7.0


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_config_switch(model_dir):
    assert float32_engine(model_dir, 0, graphs=None).graphs is None  # default: off on a CPU
    assert float32_engine(model_dir, 0, graphs=False).graphs is None
    eng = float32_engine(model_dir, 0, graphs=True)
    assert eng.graphs is not None and not eng.graphs.capture and eng.graphs.num_captured == 0
    with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(
            eng.target, None, eng.builder, max_batch=2, num_speculative_tokens=0, max_blocks=4,
            device=torch.device("cpu"), capture=True,
        )  # fmt: skip


@pytest.mark.parametrize("k", [0, 1, 3])
def test_bucketed_steps_reproduce_greedy_reference(model_dir, greedy_cases, k):
    """5 prompts with different max_tokens: the decode/verify steps run padded to buckets 8, 4, 2 as
    requests finish; tokens equal the float32 greedy continuations. Slots and KV blocks never handed
    out hold a sentinel that padding rows must not touch."""
    cases = greedy_cases["cases"][:5]
    eng = float32_engine(model_dir, k)
    caches = eng.caches
    free_slots = list(range(5, eng.engine_config.max_num_seqs))  # slots 0..4 are handed out first
    for st in caches.gdn.values():
        for t in st.tensors():
            t[free_slots] = SENTINEL
    lens = [64, 40, 23, 10, 3]
    bs = caches.block_size
    used_blocks = sum(-(-(len(c["prompt_ids"]) + n + 2 * k + 1) // bs) for c, n in zip(cases, lens))
    assert used_blocks < caches.num_blocks
    for kc, vc in caches.kv.values():
        kc[used_blocks:] = SENTINEL
        vc[used_blocks:] = SENTINEL
    res = eng.generate(
        [c["prompt_ids"] for c in cases], [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
    )
    for i, (r, c, n) in enumerate(zip(res, cases, lens)):
        assert r.output_ids == c["greedy_ids"][:n], f"k={k} case {i}"
    assert eng.graphs.target_runs > 0
    if k:
        assert eng.graphs.propose_runs == eng.graphs.target_runs
    for layer, st in caches.gdn.items():
        for t in st.tensors():
            assert (t[free_slots] == SENTINEL).all(), f"GDN layer {layer}: a padding row wrote a free slot"
    for layer, (kc, vc) in caches.kv.items():
        assert (kc[used_blocks:] == SENTINEL).all() and (vc[used_blocks:] == SENTINEL).all(), (
            f"attention layer {layer}: a padding row wrote a block no request holds"
        )
    assert caches.slots.num_free == caches.slots.num_slots


def test_mixed_steps_fall_back_to_eager(model_dir, greedy_cases):
    """Requests with different draft counts (2 and 0) share steps: those run eagerly (still exact); once
    one request is left, its steps run bucketed."""
    cases = greedy_cases["cases"][:2]
    eng = float32_engine(model_dir, 2)
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=6, ignore_eos=True, num_speculative_tokens=0),
    ]
    steps = []
    ids = [eng.add_request(c["prompt_ids"], p) for c, p in zip(cases, params)]
    reqs = list(eng.waiting)
    while eng.has_unfinished():
        before = eng.graphs.target_runs
        info = eng.step()
        steps.append((info.num_decodes, info.num_verifies, eng.graphs.target_runs - before))
    assert (1, 1, 0) in steps  # mixed: eager
    assert (0, 1, 1) in steps  # the verify request alone: bucketed
    for r, c, p in zip(reqs, cases, params):
        assert r.output_ids == c["greedy_ids"][: p.max_tokens]
    assert len(ids) == 2


def test_sampled_requests_draft_eagerly_after_a_bucketed_target(model_dir, greedy_cases):
    """A sampled request's target forward runs bucketed; its drafts (sampled on the host) come from the
    eager MTP; the same seed gives the same tokens with the bucketed path off."""
    prompt = greedy_cases["cases"][3]["prompt_ids"]
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    eng = float32_engine(model_dir, 2)
    a = eng.generate([prompt], sp)[0]
    assert eng.graphs.target_runs > 0 and eng.graphs.propose_runs == 0
    b = float32_engine(model_dir, 2, graphs=False).generate([prompt], sp)[0]
    assert a.output_ids == b.output_ids


@pytest.mark.gpu
def test_graph_replays_reproduce_greedy_and_do_not_sync_on_cuda(model_dir, greedy_cases, monkeypatch):
    """On a GPU: decode/verify steps captured (a capture fails on any host synchronisation) and replayed
    under ``torch.cuda.set_sync_debug_mode("error")``; float32 tokens equal the greedy reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: CUDA graphs and set_sync_debug_mode are CUDA features")
    from atom_models.engine import graphs as graphs_mod

    eng = float32_engine(model_dir, 2, max_model_len=128, max_num_seqs=4, device="cuda")
    real_call = graphs_mod._Entry.__call__
    replays = []

    def call(self):
        if self.graph is None:
            return real_call(self)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            replays.append(1)
            return real_call(self)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(graphs_mod._Entry, "__call__", call)
    cases = greedy_cases["cases"][:3]
    lens = [20, 12, 5]
    res = eng.generate(
        [c["prompt_ids"] for c in cases], [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
    )
    for r, c, n in zip(res, cases, lens):
        assert r.output_ids == c["greedy_ids"][:n]
    assert eng.graphs.num_captured >= 2 and replays


@pytest.mark.parametrize("k", [1, 3])
def test_device_advanced_metadata_equals_a_host_fill(model_dir, greedy_cases, k):
    """Consecutive greedy steps of the same requests run over the metadata the previous propose forward
    wrote on the device, without a host fill: before each such step it equals, row for row (padding rows
    included), what ``StepMetadata.fill`` writes for the requests as the host booked them; a step whose
    requests changed (one finished) fills; tokens equal the float32 greedy reference."""
    from atom_models.engine.step_buffers import StepMetadata

    eng = float32_engine(model_dir, k)
    g = eng.graphs
    real = g.run_target
    checked: list[int] = []

    def run_target(decodes):
        b, q = g.bucket(len(decodes)), 1 + decodes[0].num_spec
        if g._continues(decodes, b, q):
            m = g.meta
            ref = StepMetadata(max_tokens=m.input_ids.numel(), max_batch=m.seq_lens.numel(),
                               max_blocks=m.max_blocks, block_size=m.block_size, device=m.device)  # fmt: skip
            ref.fill(decodes, b, q)
            for name, n in (("input_ids", b * q), ("positions", b * q), ("slot_mapping", b * q),
                            ("seq_lens", b), ("gdn_slots", b), ("num_accepted", b), ("tables", b)):  # fmt: skip
                got, want = getattr(m, name)[:n], getattr(ref, name)[:n]
                assert torch.equal(got, want), f"{name} after step {g.target_runs}: {got} != {want}"
            checked.append(b)
        return real(decodes)

    g.run_target = run_target
    cases = greedy_cases["cases"][:3]
    lens = [30, 17, 9]
    res = eng.generate(
        [c["prompt_ids"] for c in cases], [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
    )
    for i, (r, c, n) in enumerate(zip(res, cases, lens)):
        assert r.output_ids == c["greedy_ids"][:n], f"k={k} case {i}"
    assert g.advanced_steps == len(checked) > 0
    assert set(checked) >= {4, 1}, checked  # three requests (bucket 4) and the last one alone
    assert g.meta.h2d_copies == g.target_runs - g.advanced_steps


def test_a_step_run_elsewhere_makes_the_next_step_fill(model_dir, greedy_cases):
    """Two greedy requests run bucketed; a third arrives and finishes in its prompt step (max_tokens 1),
    which runs eagerly and advances the two on the host. The next step holds the same two requests in
    the same rows, but the device's metadata is a step behind: it must fill, and tokens stay exact."""
    cases = greedy_cases["cases"][:3]
    eng = float32_engine(model_dir, 1)
    g = eng.graphs
    ids = [
        eng.add_request(c["prompt_ids"], SamplingParams(max_tokens=24, ignore_eos=True)) for c in cases[:2]
    ]
    reqs = [r for r in eng.waiting if r.request_id in ids]
    for _ in range(4):
        eng.step()
    assert g.advanced_steps > 0
    rid = eng.add_request(cases[2]["prompt_ids"], SamplingParams(max_tokens=1, ignore_eos=True))
    reqs += [r for r in eng.waiting if r.request_id == rid]
    before = (g.advanced_steps, g.meta.h2d_copies)
    eng.step()  # the prompt step: eager, the two advance on the host
    eng.step()  # the same two requests again: a fill, not the device's stale metadata
    assert (g.advanced_steps, g.meta.h2d_copies) == (before[0], before[1] + 1)
    while eng.has_unfinished():
        eng.step()
    assert [len(r.output_ids) for r in reqs] == [24, 24, 1]
    for i, (c, r) in enumerate(zip(cases, reqs)):
        assert r.output_ids == c["greedy_ids"][: len(r.output_ids)], f"request {i}"


def _request(rid: int, blocks: list[int], slot: int, computed: int, drafts: list[int]):
    from atom_models.engine.request import Request

    req = Request(rid, list(range(100, 100 + computed)), SamplingParams(), len(drafts))
    req.blocks, req.slot, req.drafts = blocks, slot, drafts
    req.num_computed, req.num_accepted, req.output_ids = computed, 2, [50 + rid]
    return req


def test_step_metadata_fill_matches_the_per_token_layout():
    """StepMetadata.fill (vectorised, one copy) writes what the per-token layout gives: positions from
    num_computed, KV slots through the block tables (a span crossing a block boundary), padding rows;
    a table row is rewritten when its request changes."""
    from atom_models.engine.step_buffers import StepMetadata

    bs, q = 4, 3
    meta = StepMetadata(
        max_tokens=8 * q, max_batch=8, max_blocks=5, block_size=bs, device=torch.device("cpu")
    )
    r0 = _request(0, [7, 3, 9], slot=2, computed=6, drafts=[12, 13])  # positions 6..8: blocks 3 and 9
    r1 = _request(1, [5, 1], slot=0, computed=2, drafts=[14, 15])
    for decodes, b in (((r0, r1), 4), ((r1,), 1)):
        meta.fill(decodes, b, q)
        ids, pos, slots = [], [], []
        for req in decodes:
            ids += [req.last_token, *req.drafts]
            pos += range(req.num_computed, req.num_computed + q)
            slots += [req.blocks[p // bs] * bs + p % bs for p in pos[-q:]]
        n, pad = len(decodes), b - len(decodes)
        assert meta.input_ids[: b * q].tolist() == ids + [0] * (pad * q)
        assert meta.positions[: b * q].tolist() == pos + list(range(q)) * pad
        assert meta.slot_mapping[: b * q].tolist() == slots + [-1] * (pad * q)
        assert meta.seq_lens[:b].tolist() == [r.num_computed + q for r in decodes] + [q] * pad
        assert meta.gdn_slots[:b].tolist() == [r.slot for r in decodes] + [-1] * pad
        assert meta.num_accepted[:b].tolist() == [2] * n + [1] * pad
        tables = [r.blocks + [0] * (5 - len(r.blocks)) for r in decodes] + [[0] * 5] * pad
        assert meta.tables[:b].tolist() == tables
    assert meta.h2d_copies == 2
    short = _request(2, [4], slot=1, computed=3, drafts=[16, 17])  # positions 3..5 need block 1: one held
    with pytest.raises(
        ValueError, match=r"request 2: positions up to 5 need block 1, but it holds 1 blocks of 4"
    ):
        meta.fill((short,), 1, q)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [5, 6, 7, 8])
def test_long_drafts_reproduce_greedy_graphed_on_cuda(model_dir, greedy_cases, k):
    """On a GPU, k = 5..8 (up to ``MAX_SPECULATIVE_TOKENS``): every greedy.json case decoded with captured
    verify/propose graphs equals the float32 reference; acceptance per draft position is printed, and the
    first position (the k = 1 draft) stays above half of its measured rate."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: the graphed verify of 1 + k tokens is captured there")
    cases = greedy_cases["cases"]
    eng = float32_engine(model_dir, k, device="cuda")
    params = SamplingParams(max_tokens=greedy_cases["max_new_tokens"], ignore_eos=True)
    res = eng.generate([c["prompt_ids"] for c in cases], params)
    bad = greedy_mismatch(res, cases)
    assert bad is None, f"k={k}: {bad}"
    assert eng.graphs.target_runs > 0 and eng.graphs.propose_runs == eng.graphs.target_runs
    drafts = sum(r.stats.num_drafts for r in res)
    per_pos = [sum(r.stats.accepted_per_position[i] for r in res) / drafts for i in range(k)]
    print(f"k={k}: acceptance per draft position {[round(a, 3) for a in per_pos]}")
    assert per_pos[0] >= MIN_ACCEPTANCE[1] / 2, f"k={k}: first-position acceptance {per_pos[0]:.3f}"
