"""The GDN pipeline (``atom_models.gdn_pipeline``): decode and verify parts against the dense prefill, the
fused gating of decode / verify against the gating op followed by the unfused rule, the pending-token
reset, and no host synchronisation in decode / verify forwards.

Host syncs are caught on CPU by ``HostSyncGuard`` (kernels exempt: the reference ops validate values on the
host, the GPU ops must not) and on a GPU by ``torch.cuda.set_sync_debug_mode("error")`` with every op
included. The guard's own tests show it raises on each kind of sync, so these tests can fail.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from _helpers import K_SPEC, gdn_state
from atom_kernels import select_kernels
from atom_models.dense_cores import DenseContext, DenseGDNCore
from atom_models.engine import EngineConfig, LLMEngine, SamplingParams
from atom_models.gdn_meta import GDNDecodeMeta, GDNPrefillMeta, GDNStepMeta, GDNVerifyMeta
from atom_models.gdn_pipeline import gdn_forward, reset_pending
from atom_models.gdn_state import GDNGeometry
from atom_models.host_sync import HostSyncError, HostSyncGuard
from atom_models.testing import random_gdn_layer, tiny_config

# float32, reference kernels: pipeline output vs the dense chunked prefill over the whole sequence;
# measured max |error| 1.2e-6 (recurrent / verify vs chunked summation order)
ATOL = {torch.float32: 1e-4}


@pytest.fixture(scope="module")
def layer_setup():
    torch.manual_seed(0)
    cfg = tiny_config()
    kern = select_kernels("cpu", torch.float32, backend="reference")
    return cfg, kern, random_gdn_layer(cfg, kern)


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def _tokens(n: int, geo: GDNGeometry) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(n, geo.conv_dim),
        "b": torch.randn(n, geo.num_v_heads),
        "a": torch.randn(n, geo.num_v_heads),
    }


def _run(kern, geo, layer, state, toks, step):
    return gdn_forward(kern, geo, layer.gdn_weights(), state, toks["x"], toks["b"], toks["a"], step)


def test_ragged_verify_and_decode_match_dense(layer_setup):
    """Prefill A (5) and B (4) in slots 2 and 0; then one step with B decoding... through the verify part,
    gathered: A verifies 3 tokens, B 1 token (padded to Q = 3, its padding dropped), in the flat order
    [B, A]; then A commits all 3, B commits 1, and both verify again, contiguous. Each output equals the
    dense pipeline over the sequence so far; a plain decode part on a third sequence likewise."""
    cfg, kern, layer = layer_setup
    geo = GDNGeometry.from_config(cfg, K_SPEC)
    state = gdn_state(geo)
    state.pending.fill_(5.0)  # stale tokens of earlier owners: the prefill must make them identities
    dense = DenseGDNCore(cfg, kern)
    torch.manual_seed(1)
    A, B, C = _tokens(11, geo), _tokens(7, geo), _tokens(6, geo)

    def ref(seq, n):
        sl = {k: v[:n] for k, v in seq.items()}
        return dense(sl["x"], sl["b"], sl["a"], layer.gdn_weights(), DenseContext((n,)))

    def cat(*parts):
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def sl(seq, lo, hi):
        return {k: v[lo:hi] for k, v in seq.items()}

    pre = GDNPrefillMeta(3, 14, _i32([0, 5, 9, 14]), _i32([2, 0, 3]), torch.zeros(3, dtype=torch.bool))
    out = _run(kern, geo, layer, state, cat(sl(A, 0, 5), sl(B, 0, 4), sl(C, 0, 5)), GDNStepMeta(prefill=pre))
    atol = ATOL[torch.float32]
    err = (out[:5] - ref(A, 5)).abs().max().item()
    assert err < atol, f"prefill A: max error {err}"

    # flat batch [B4, A5, A6, A7, C5]: B and A verify (gathered), C a plain decode
    batch = cat(sl(B, 4, 5), sl(A, 5, 8), sl(C, 5, 6))
    ver = GDNVerifyMeta(
        2, 3, _i32([0, 2]), _i32([1, 1]),
        gather_index=torch.tensor([0, 0, 0, 1, 2, 3]), scatter_index=torch.tensor([0, -1, -1, 1, 2, 3]),
    )  # fmt: skip
    dec = GDNDecodeMeta(1, _i32([3]), token_start=4)
    out = _run(kern, geo, layer, state, batch, GDNStepMeta(decodes=(dec,), verifies=(ver,)))
    for name, got, want in [
        ("B (1 token, padded)", out[0], ref(B, 5)[4]),
        ("A (3 tokens)", out[1:4], ref(A, 8)[5:8]),
        ("C (plain decode)", out[4], ref(C, 6)[5]),
    ]:
        err = (got - want).abs().max().item()
        assert err < atol, f"{name}: max error {err}"

    # A accepted 3, B 1: contiguous verify of 3 tokens each, [A8..A10 | B5..B7]
    batch = cat(sl(A, 8, 11), sl(B, 5, 7), sl(B, 5, 6))
    ver = GDNVerifyMeta(2, 3, _i32([2, 0]), _i32([3, 1]))
    out = _run(kern, geo, layer, state, batch, GDNStepMeta(verifies=(ver,)))
    err = (out[:3] - ref(A, 11)[8:11]).abs().max().item()
    assert err < atol, f"A after committing 3: max error {err}"
    err = (out[3:5] - ref(B, 7)[5:7]).abs().max().item()
    assert err < atol, f"B after committing 1: max error {err}"


def _gating_op_then_rule(kern):
    """``kern`` with recurrent / verify ops that take the pipeline's fused-gating call (raw a/b, A_log,
    dt_bias) and run the gating op, then the rule on g/beta: the unfused composition."""

    def gates(a, b, A_log, dt_bias):
        hv = a.shape[-1]
        g, beta = kern.gdn_gating(A_log, a.reshape(-1, hv), dt_bias, b.reshape(-1, hv))
        return g.view(a.shape), beta.view(a.shape)

    def recurrent(q, k, v, a, b, *args, A_log, dt_bias, **kwargs):
        return kern.gated_delta_rule_recurrent(q, k, v, *gates(a, b, A_log, dt_bias), *args, **kwargs)

    def verify(q, k, v, a, b, *args, A_log, dt_bias, **kwargs):
        return kern.gated_delta_rule_verify(q, k, v, *gates(a, b, A_log, dt_bias), *args, **kwargs)

    return dataclasses.replace(kern, gated_delta_rule_recurrent=recurrent, gated_delta_rule_verify=verify)


def test_fused_gating_equals_gating_op_then_rule(layer_setup):
    """Prefill, a step with a plain decode part and a gathered, padded verify part, then a contiguous
    verify step: outputs and every state tensor (conv, ssm, pending) after each step are bit-identical
    between the pipeline (gating fused into the decode / verify ops) and the gating op + unfused rule."""
    cfg, kern, layer = layer_setup
    geo = GDNGeometry.from_config(cfg, K_SPEC)
    torch.manual_seed(3)
    toks = _tokens(14, geo)
    pre = GDNPrefillMeta(3, 14, _i32([0, 5, 9, 14]), _i32([2, 0, 3]), torch.zeros(3, dtype=torch.bool))
    mixed = GDNStepMeta(
        decodes=(GDNDecodeMeta(1, _i32([3]), token_start=4),),
        verifies=(
            GDNVerifyMeta(
                2, 3, _i32([0, 2]), _i32([1, 1]),
                gather_index=torch.tensor([0, 0, 0, 1, 2, 3]), scatter_index=torch.tensor([0, -1, -1, 1, 2, 3]),
            ),
        ),
    )  # fmt: skip
    contiguous = GDNStepMeta(verifies=(GDNVerifyMeta(1, 3, _i32([2]), _i32([3]), token_start=1),))
    fused_state = gdn_state(geo)
    unfused_state = gdn_state(geo)
    unfused = _gating_op_then_rule(kern)
    for i, (step, rows) in enumerate([(GDNStepMeta(prefill=pre), 14), (mixed, 5), (contiguous, 5)]):
        batch = {k: v[:rows] for k, v in toks.items()}
        out_f = _run(kern, geo, layer, fused_state, batch, step)
        out_u = _run(unfused, geo, layer, unfused_state, batch, step)
        assert torch.equal(out_f, out_u), f"step {i}: outputs differ by {(out_f - out_u).abs().max()}"
        for name, f, u in zip(("conv", "ssm", "pending"), fused_state.tensors(), unfused_state.tensors()):
            assert torch.equal(f, u), f"step {i}: {name} state differs by {(f - u).abs().max()}"


@pytest.mark.parametrize(
    "slots, zeroed",
    [([-1, 3, -1, 1], [1, 3]), ([-1, -1], []), ([0, -1], [0]), ([2, 2, -1], [2]), ([], [])],
    ids=["mixed", "padding_only", "slot0_and_padding", "repeated", "empty"],
)
def test_reset_pending_touches_real_slots_only(slots, zeroed):
    """Exactly the real slots' ``pending[s, 0]`` become zero; padding rows change nothing (also in a batch
    of padding only, and when slot 0 is real)."""
    pending = torch.arange(4 * 3 * 5, dtype=torch.float32).view(4, 3, 5) + 1.0
    expect = pending.clone()
    expect[zeroed, 0] = 0.0
    idx = _i32(slots)
    with HostSyncGuard():
        reset_pending(pending, idx)
    assert torch.equal(pending, expect), f"slots {slots}: rows changed {(pending != expect).any(-1)}"


@pytest.mark.parametrize(
    "what",
    ["item", "int", "bool", "tolist", "nonzero", "bool_index", "tensor_from_list", "repeat_interleave"],
)
def test_guard_catches_each_kind_of_host_sync(what):
    x = torch.arange(6)
    actions = {
        "item": lambda: x[1].item(),
        "int": lambda: int(x[1]),
        "bool": lambda: bool(x[1] > 0),
        "tolist": lambda: x.tolist(),
        "nonzero": lambda: torch.nonzero(x),
        "bool_index": lambda: x[x > 2],
        "tensor_from_list": lambda: torch.tensor([1, 2]),
        "repeat_interleave": lambda: torch.repeat_interleave(x, x),
    }
    guard = HostSyncGuard()
    with guard, pytest.raises(HostSyncError):
        actions[what]()
    with guard, guard.exempt():
        actions[what]()  # exempt: runs
    assert x.tolist() == list(range(6))  # the guard put Tensor.tolist back


def _guard_forwards(eng, monkeypatch, guard):
    """Run every target forward without a prefill part, and every MTP forward, inside ``guard``."""
    seen = {"target": 0, "mtp": 0}

    def wrap(name, module):
        real = module.forward

        def forward(*args, **kwargs):
            ctx = args[2] if name == "target" else args[3]
            if name == "target" and ctx.gdn.prefill is not None:
                return real(*args, **kwargs)
            seen[name] += 1
            with guard:
                return real(*args, **kwargs)

        monkeypatch.setattr(module, "forward", forward)

    wrap("target", eng.target)
    wrap("mtp", eng.mtp)
    return seen


def test_engine_decode_and_verify_forwards_do_not_sync_on_cpu(model_dir, greedy_cases, monkeypatch):
    """The engine's decode/verify target forwards and its MTP forwards (k = 2, one request without MTP
    for the plain decode part) do no host work on device values; the result is still the reference."""
    guard = HostSyncGuard()
    kern = guard.exempt_kernels(select_kernels("cpu", torch.float32))
    cfg = EngineConfig(num_speculative_tokens=2, max_model_len=128, max_num_seqs=2)
    eng = LLMEngine.from_pretrained(model_dir, cfg, dtype=torch.float32, kernels=kern)
    seen = _guard_forwards(eng, monkeypatch, guard)
    cases = greedy_cases["cases"][:2]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, num_speculative_tokens=n) for n in (2, 0)]
    res = eng.generate([c["prompt_ids"] for c in cases], params)
    assert seen["target"] > 0 and seen["mtp"] > 0, seen
    for r, c in zip(res, cases):
        assert r.output_ids == c["greedy_ids"][:8]


class CudaSyncDebug:
    """``torch.cuda.set_sync_debug_mode("error")`` while entered: any device-to-host sync raises."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_pipeline_decode_and_verify_do_not_sync_on_cuda():
    """The GDN pipeline alone with the GPU's kernels (triton): a step with a plain decode part and a
    gathered, padded verify part, then a contiguous verify step, under the CUDA sync check."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.set_sync_debug_mode only sees CUDA synchronisation")
    dev = torch.device("cuda")
    cfg = tiny_config()
    kern = select_kernels(dev, torch.bfloat16)
    with torch.device(dev):
        layer = random_gdn_layer(cfg, kern, torch.bfloat16)
    geo = GDNGeometry.from_config(cfg, K_SPEC)
    state = gdn_state(geo, conv_dtype=torch.bfloat16, device=dev)
    toks = {k: v.to(dev, torch.bfloat16) for k, v in _tokens(14, geo).items()}
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device=dev)
    pre = GDNPrefillMeta(
        3, 14, i32([0, 5, 9, 14]), i32([2, 0, 3]), torch.zeros(3, dtype=torch.bool, device=dev)
    )
    _run(kern, geo, layer, state, toks, GDNStepMeta(prefill=pre))
    batch = {k: v[:5] for k, v in toks.items()}
    mixed = GDNStepMeta(
        decodes=(GDNDecodeMeta(1, i32([3]), token_start=4),),
        verifies=(
            GDNVerifyMeta(
                2, 3, i32([0, 2]), i32([1, 1]),
                gather_index=torch.tensor([0, 0, 0, 1, 2, 3], device=dev),
                scatter_index=torch.tensor([0, -1, -1, 1, 2, 3], device=dev),
            ),
        ),
    )  # fmt: skip
    contiguous = GDNStepMeta(verifies=(GDNVerifyMeta(1, 3, i32([2]), i32([3]), token_start=1),))
    with torch.no_grad(), CudaSyncDebug():
        out = _run(kern, geo, layer, state, batch, mixed)
        out2 = _run(kern, geo, layer, state, batch, contiguous)
    torch.cuda.synchronize()
    assert out.isfinite().all() and out2.isfinite().all()


@pytest.mark.gpu
def test_engine_decode_and_verify_forwards_do_not_sync_on_cuda(model_dir, greedy_cases, monkeypatch):
    """On a GPU with the default (triton) kernels: decode/verify target forwards and MTP forwards under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises at any device-to-host synchronisation."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.set_sync_debug_mode only sees CUDA synchronisation")

    cfg = EngineConfig(num_speculative_tokens=2, max_model_len=128, max_num_seqs=2, cuda_graphs=False)
    eng = LLMEngine.from_pretrained(model_dir, cfg, dtype=torch.float32, device="cuda")
    seen = _guard_forwards(eng, monkeypatch, CudaSyncDebug())
    cases = greedy_cases["cases"][:2]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, num_speculative_tokens=n) for n in (2, 0)]
    res = eng.generate([c["prompt_ids"] for c in cases], params)
    assert seen["target"] > 0 and seen["mtp"] > 0, seen
    for r, c in zip(res, cases):
        assert r.output_ids == c["greedy_ids"][:8]
