"""Greedy acceptance on the device (engine.graphs' acceptance + propose forward) and the graphed greedy
step's single host round trip.

``verify_greedy_rows`` must equal the host's ``verify_greedy`` per sequence; a graphed greedy engine
(bucketed path, eager on a CPU) must leave every request in the state the host-decided path leaves it
(outputs, drafts, computed / accepted positions, statistics, finish reasons: eos and max_tokens inside an
accepted span included), with one metadata copy to the device and one result read per step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _helpers import float32_engine
from atom_models.engine import LLMEngine, SamplingParams
from atom_models.engine import model_runner as runner_mod
from atom_models.engine.sampling import verify_greedy, verify_greedy_rows


@pytest.mark.parametrize(
    "best, drafts",
    [
        ([5, 6, 7, 8], [5, 6, 7]),  # all accepted: bonus token 8
        ([5, 6, 7, 8], [4, 6, 7]),  # none: corrected token 5
        ([5, 6, 7, 8], [5, 6, 9]),  # partial: 2 accepted
        ([5, 6, 7, 8], [5, 9, 7]),  # a later match after a mismatch does not count
        ([3], []),  # plain decode (q = 1)
    ],
    ids=["all", "none", "partial", "gap", "no-drafts"],
)
def test_verify_greedy_rows_equals_verify_greedy(best, drafts):
    q = len(best)
    ids = torch.tensor([[11, *drafts], [12, *best[:-1]]])  # the second sequence accepts everything
    rows = torch.tensor([best, best])
    accepted, tokens = verify_greedy_rows(rows.view(-1), ids.view(-1), q)
    for i in range(2):
        a, emitted = verify_greedy(rows[i].tolist(), ids[i, 1:].tolist())
        assert int(accepted[i]) == a
        assert tokens[i, : a + 1].tolist() == emitted


def test_verify_greedy_rows_random_batches():
    gen = torch.Generator().manual_seed(0)
    for q in (1, 2, 4):
        best = torch.randint(0, 3, (64 * q,), generator=gen)
        ids = torch.randint(0, 3, (64 * q,), generator=gen)
        accepted, tokens = verify_greedy_rows(best, ids, q)
        for i in range(64):
            a, emitted = verify_greedy(
                best[i * q : (i + 1) * q].tolist(), ids[i * q + 1 : (i + 1) * q].tolist()
            )
            assert (int(accepted[i]), tokens[i, : a + 1].tolist()) == (a, emitted)


def _engine(model_dir, k: int, graphs: bool, eos: tuple[int, ...]) -> LLMEngine:
    eng = float32_engine(model_dir, k, graphs)
    eng.config = dataclasses.replace(eng.config, eos_token_id=eos)
    eng.scheduler.eos_token_id = eos  # the scheduler's stop rule (it read the config when built)
    return eng


def _first_new_token(ids: list[int], start: int) -> int:
    """The first output index ``>= start`` whose token does not occur before it (an eos stop there)."""
    return next(j for j in range(start, len(ids)) if ids[j] not in ids[:j])


def _state(eng: LLMEngine) -> list[tuple]:
    reqs = sorted([*eng.running, *eng.waiting], key=lambda r: r.request_id)
    return [
        (r.request_id, r.output_ids, r.drafts, r.num_computed, r.num_accepted, r.finished, r.stats.as_dict())
        for r in reqs
    ]


@pytest.mark.parametrize("k", [1, 3])
def test_graphed_greedy_steps_equal_the_host_path(model_dir, greedy_cases, k, monkeypatch):
    """Lock-step: a graphed and a host-decided engine over the same 5 greedy requests; after every step
    the requests' states are equal. Request 0 stops on an eos token first emitted at output 14, the
    others at max_tokens not aligned to 1 + k, and with k = 3 both stops fall inside an accepted span
    (tokens read from the device that are not emitted). Every graphed greedy step reads its results once
    and never reads the logits; it copies its metadata once, or not at all when the same requests continue
    over the metadata the previous step advanced on the device."""
    cases = greedy_cases["cases"][:5]
    eos_tok = cases[0]["greedy_ids"][_first_new_token(cases[0]["greedy_ids"], 14)]
    engines = [_engine(model_dir, k, graphs, (eos_tok,)) for graphs in (True, False)]
    lens = [40, 13, 7, 10, 22]
    for eng in engines:
        for c, n in zip(cases, lens):
            eng.add_request(c["prompt_ids"], SamplingParams(max_tokens=n, ignore_eos=c is not cases[0]))
    graphed, host = engines
    g = graphed.graphs
    logit_reads, results = [], []
    real_host_tokens, real_run_greedy = runner_mod.host_tokens, g.run_greedy

    def host_tokens(*args, **kwargs):
        logit_reads.append(1)
        return real_host_tokens(*args, **kwargs)

    def run_greedy(spans):
        out = real_run_greedy(spans)
        results.extend((sp.request, res, len(sp.request.output_ids)) for sp, res in zip(spans, out))
        return out

    monkeypatch.setattr(runner_mod, "host_tokens", host_tokens)
    monkeypatch.setattr(g, "run_greedy", run_greedy)

    def counters():
        return g.propose_runs, g.reader.reads, g.meta.h2d_copies, len(logit_reads), g.advanced_steps

    graphed_steps, advanced_steps, cut = 0, 0, set()
    while host.has_unfinished():
        before = counters()
        results.clear()
        info = graphed.step()  # counted alone: the host engine reads its logits
        runs, reads, copies, logits, advanced = (now - then for now, then in zip(counters(), before))
        infos = [info, host.step()]
        if runs:
            graphed_steps += 1
            assert (reads, copies + advanced, logits) == (1, 1, 0), (
                "a graphed greedy step: one result read; one metadata copy, or none over the metadata the "
                "device advanced"
            )
            advanced_steps += advanced
        assert infos[0] == infos[1]
        assert _state(graphed) == _state(host)
        for req, res, pre in results:
            if req.finished and len(req.output_ids) - pre < len(res.tokens):
                cut.add(req.finish_reason)
        assert all(len(r.drafts) == k for r in graphed.running)
    assert not graphed.has_unfinished()
    assert graphed_steps > 5
    assert 0 < advanced_steps < graphed_steps  # steps after a finish fill
    if k == 3:
        assert cut == {"stop", "length"}, cut


def test_eos_inside_the_accepted_span_is_reported(model_dir, greedy_cases):
    """The eos request of the lock-step test stops with reason "stop" at its eos token; the others with
    "length" at exactly max_tokens; no finished request keeps drafts."""
    cases = greedy_cases["cases"][:3]
    stop = _first_new_token(cases[0]["greedy_ids"], 14)
    eos_tok = cases[0]["greedy_ids"][stop]
    eng = _engine(model_dir, 3, True, (eos_tok,))
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=13, ignore_eos=True)]
    params.append(SamplingParams(max_tokens=6, ignore_eos=True))
    ids = [eng.add_request(c["prompt_ids"], p) for c, p in zip(cases, params)]
    reqs = {r.request_id: r for r in eng.waiting}
    while eng.has_unfinished():
        eng.step()
    r0, r1, r2 = (reqs[i] for i in ids)
    assert (r0.output_ids, r0.finish_reason) == (cases[0]["greedy_ids"][: stop + 1], "stop")
    assert (r1.output_ids, r1.finish_reason) == (cases[1]["greedy_ids"][:13], "length")
    assert (r2.output_ids, r2.finish_reason) == (cases[2]["greedy_ids"][:6], "length")
    assert all(r.drafts == [] for r in (r0, r1, r2))
    assert eng.graphs.propose_runs > 0


@pytest.mark.gpu
def test_graphed_greedy_step_syncs_once_on_cuda(model_dir, greedy_cases, monkeypatch):
    """On a GPU, once its bucket is captured, a graphed greedy step runs under
    ``torch.cuda.set_sync_debug_mode("error")`` except inside the one result read; tokens equal the
    float32 greedy reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: CUDA graphs and set_sync_debug_mode are CUDA features")
    from atom_models.engine import step_buffers

    eng = float32_engine(model_dir, 2, max_model_len=128, max_num_seqs=4, device="cuda")
    real_read, real_step = step_buffers.ResultReader.read, runner_mod.ModelRunner._run_greedy_graphed
    checked = []

    def read(self, values):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real_read(self, values)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def step(self, sched):
        d = sched.decodes
        if (1 + d[0].num_spec, self.graphs.bucket(len(d))) not in self.graphs._targets:
            return real_step(self, sched)  # the capture synchronises
        reads = self.graphs.reader.reads
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = real_step(self, sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(self.graphs.reader.reads - reads)
        return out

    monkeypatch.setattr(step_buffers.ResultReader, "read", read)
    monkeypatch.setattr(runner_mod.ModelRunner, "_run_greedy_graphed", step)
    cases = greedy_cases["cases"][:3]
    lens = [20, 12, 5]
    res = eng.generate(
        [c["prompt_ids"] for c in cases], [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
    )
    for r, c, n in zip(res, cases, lens):
        assert r.output_ids == c["greedy_ids"][:n]
    assert checked and set(checked) == {1}
