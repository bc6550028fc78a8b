"""The GDN input projections are stored part-major (``weight_map`` ``regroup``), so their outputs reach the
core and the output norm as views: no copy between the projections and the core, in decode and verify form,
and the same outputs as contiguous copies; the row regrouping itself; FP8 block scales that cannot move
with their rows are refused by name; ``in_proj_ba`` goes through ``kernels.linear`` (at TP = 1 and on a
TP = 2 rank)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from _helpers import K_SPEC, gdn_state
from atom_core import Qwen3NextConfig
from atom_kernels import select_kernels
from atom_models import CheckpointError, DenseCoreFactory, Qwen3NextForCausalLM, load_target
from atom_models.gdn import GatedDeltaNet
from atom_models.gdn_meta import GDNDecodeMeta, GDNStepMeta, GDNVerifyMeta
from atom_models.gdn_pipeline import gdn_forward
from atom_models.gdn_state import GDNGeometry
from atom_models.parallel import RankWithoutGroup
from atom_models.parallel.slices import regroup_rows
from atom_models.testing import normal_parameters_, random_gdn_layer, tiny_config
from atom_models.weight_map import GDN_BA, GDN_QKVZ, group_parts
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that copy tensor data (a .contiguous() or copying reshape dispatches as clone / _reshape_copy)
COPY_OPS = {"clone", "copy_", "_to_copy", "cat", "stack", "index", "index_select", "gather", "_reshape_copy"}
# float32: views vs contiguous copies through the same kernels; measured 0 (the reference on CPU may
# differ by an ulp where a strided elementwise loop is not vectorised)
ATOL = 1e-6


class _AtenOps(TorchDispatchMode):
    """Names of the aten ops dispatched, with markers the spies append."""

    def __init__(self):
        super().__init__()
        self.log: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _PipelineCore(torch.nn.Module):
    """The shared GDN pipeline over one state, recording what the layer hands it (``contiguous``: on
    contiguous copies instead, the comparison run)."""

    def __init__(self, kernels, geometry, state, step, ops: _AtenOps | None, contiguous: bool = False):
        super().__init__()
        self.kernels, self.geometry, self.state, self.step = kernels, geometry, state, step
        self.ops, self.contiguous, self.seen = ops, contiguous, None

    def forward(self, mixed_qkv, b, a, weights, ctx):
        if self.ops is not None:
            self.ops.log.append("<core>")
        self.seen = (mixed_qkv, b, a)
        if self.contiguous:
            mixed_qkv, b, a = mixed_qkv.contiguous(), b.contiguous(), a.contiguous()
        return gdn_forward(self.kernels, self.geometry, weights, self.state, mixed_qkv, b, a, self.step)


GDN_OPS = ("causal_conv1d_update", "gated_delta_rule_recurrent", "gated_delta_rule_verify", "gated_rms_norm")


def _kernels(backend: str):
    """``reference`` for every op, or the best backend per op with Triton for the GDN ops (skips where
    Triton does not run them: on CPU it needs TRITON_INTERPRET=1)."""
    if backend == "reference":
        return select_kernels("cpu", torch.float32, backend="reference")
    kern = select_kernels("cpu", torch.float32)
    missing = [op for op in GDN_OPS if kern.backend_of(op) != backend]
    if missing:
        pytest.skip(
            f"no {backend} kernels for {missing} on CPU (Triton runs there only with TRITON_INTERPRET=1)"
        )
    return kern


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("form", ["decode", "verify"])
def test_projection_views_reach_the_core_without_copies(backend, form):
    """One decode step of 3 sequences / one verify step of 2 x (1 + K_SPEC) tokens: ``mixed_qkv`` / ``z``
    are views of the ``in_proj_qkvz`` output and ``b`` / ``a`` of the ``in_proj_ba`` output (same storage,
    row stride the projection's width), no aten op before the core copies data, and the layer's output and
    states equal those of a core fed contiguous copies."""
    torch.manual_seed(0)
    cfg, kern = tiny_config(), _kernels(backend)
    geo = GDNGeometry.from_config(cfg, K_SPEC)
    layer = random_gdn_layer(cfg, kern)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    if form == "decode":
        step, t = GDNStepMeta(decodes=(GDNDecodeMeta(3, slots),)), 3
    else:
        q = 1 + K_SPEC
        verify = GDNVerifyMeta(2, q, slots[:2], torch.tensor([1, 2], dtype=torch.int32))
        step, t = GDNStepMeta(verifies=(verify,)), 2 * q
    state = gdn_state(geo)
    with torch.no_grad():
        state.conv.normal_(0, 0.3)
        state.ssm.normal_(0, 0.1)
        if state.pending is not None:
            state.pending.normal_(0, 0.1)
    states = {
        name: dataclasses.replace(
            state, conv=state.conv.clone(), ssm=state.ssm.clone(), pending=state.pending.clone()
        )
        for name in ("views", "copies")
    }
    x = torch.randn(t, cfg.hidden_size)

    outs, proj = {}, {}
    layer.in_proj_qkvz.register_forward_hook(lambda m, i, o: proj.__setitem__("qkvz", o))
    layer.in_proj_ba.register_forward_hook(lambda m, i, o: proj.__setitem__("ba", o))
    norm = kern.gated_rms_norm
    ops = _AtenOps()
    zs: list[torch.Tensor] = []

    def norm_spy(o, z, w, eps):
        ops.log.append("<norm>")
        zs.append(z)
        return norm(o, z, w, eps)

    layer.kernels = dataclasses.replace(kern, gated_rms_norm=norm_spy)
    for name in ("copies", "views"):
        layer.core = _PipelineCore(kern, geo, states[name], step, ops, contiguous=name == "copies")
        ops.log.clear()
        with torch.no_grad(), ops:
            outs[name] = layer(torch.arange(t), x, ctx=None)
    before_core = ops.log[: ops.log.index("<core>")]
    copies = sorted(set(before_core) & COPY_OPS)
    assert not copies, f"{form}: copies between the projections and the core: {copies} (ops: {before_core})"
    mixed_qkv, b, a = layer.core.seen
    z = zs[-1]
    width = proj["qkvz"].shape[1]
    for name, view, base in (
        ("mixed_qkv", mixed_qkv, "qkvz"),
        ("z", z, "qkvz"),
        ("b", b, "ba"),
        ("a", a, "ba"),
    ):
        assert _storage(view) == _storage(proj[base]), f"{name} is not a view of the in_proj_{base} output"
    assert mixed_qkv.stride() == (width, 1) and z.stride() == (width, geo.head_v_dim, 1)
    assert b.stride() == a.stride() == (2 * geo.num_v_heads, 1)
    assert torch.allclose(outs["views"], outs["copies"], atol=ATOL, rtol=0), f"{form}: views vs copies"
    for what in ("conv", "ssm", "pending"):
        got, want = getattr(states["views"], what), getattr(states["copies"], what)
        assert torch.allclose(got, want, atol=ATOL, rtol=0), f"{form}: {what} state, views vs copies"


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("rank", [None, 0, 1])
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_in_proj_ba_goes_through_kernels_linear(backend, rank, tokens):
    """``in_proj_ba`` calls ``kernels.linear`` once with its weight (with the triton backend: the GEMV at
    1-2 tokens, F.linear at 3) and returns F.linear's values; ``in_proj_qkvz`` does not call it. ``rank``:
    the layer of that TP = 2 rank (its ``2 * Hv / 2`` rows), None: TP = 1."""
    kern = select_kernels("cpu", torch.float32, backend="reference" if backend == "reference" else None)
    if kern.backend_of("linear") != backend:
        pytest.skip(f"no {backend} linear on CPU (Triton runs there only with TRITON_INTERPRET=1)")
    calls = []

    def linear_spy(x, w, b=None):
        calls.append((tuple(x.shape), w))
        return kern.linear(x, w, b)

    cfg = tiny_config()
    torch.manual_seed(0)
    spied = dataclasses.replace(kern, linear=linear_spy)
    parallel = {} if rank is None else {"parallel": RankWithoutGroup(rank, 2)}
    layer = normal_parameters_(GatedDeltaNet(cfg, 0, core=None, kernels=spied, **parallel), 0.5)
    x = torch.randn(tokens, cfg.hidden_size)
    with torch.no_grad():
        y = layer.in_proj_ba(x)
        layer.in_proj_qkvz(x)
    rows = 2 * cfg.linear_num_value_heads // (1 if rank is None else 2)
    assert (
        len(calls) == 1
        and calls[0][0] == (tokens, cfg.hidden_size)
        and calls[0][1] is layer.in_proj_ba.weight
    )
    assert y.shape == (tokens, rows) and layer.in_proj_ba.weight.shape[0] == rows
    # float32: the GEMV sums in another order than F.linear; measured 6.0e-07 at |y| ~ 10 (interpreter),
    # 0 (reference)
    torch.testing.assert_close(
        y, torch.nn.functional.linear(x, layer.in_proj_ba.weight), atol=1e-5, rtol=1e-5
    )


def test_regroup_rows_is_part_major():
    """Two groups of parts (2, 1, 3) rows: ``[p0_0 p1_0 p2_0 | p0_1 p1_1 p2_1]`` -> ``[p0_0 p0_1 | p1_0 ...]``;
    trailing dims ride along."""
    rows = torch.arange(12).repeat_interleave(3).view(12, 3)
    got = regroup_rows(rows, (2, 1, 3))[:, 0].tolist()
    assert got == [0, 1, 6, 7, 2, 8, 3, 4, 5, 9, 10, 11]
    with pytest.raises(ValueError, match=r"11 rows are not whole groups of parts \[2, 1, 3\]"):
        regroup_rows(rows[:11], (2, 1, 3))


def test_loaded_projections_are_the_checkpoint_rows_part_major(model_dir, kernels32):
    """The tiny fixture's in_proj_qkvz / in_proj_ba as loaded: ``[q | k | v | z]`` / ``[b | a]`` of the
    checkpoint's per-key-head groups (HF's ``fix_query_key_value_ordering`` split, then concatenated)."""
    cfg = Qwen3NextConfig.from_hf(model_dir)
    target = Qwen3NextForCausalLM(cfg, DenseCoreFactory(kernels32), kernels32)
    load_target(target, model_dir)
    gdn = target.model.layers[0].linear_attn
    files = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    hk, hv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    r = hv // hk
    for name, regroup, module in (
        ("in_proj_qkvz", GDN_QKVZ, gdn.in_proj_qkvz),
        ("in_proj_ba", GDN_BA, gdn.in_proj_ba),
    ):
        key = f"model.layers.0.linear_attn.{name}.weight"
        with safe_open(str(model_dir / files[key]), framework="pt") as f:
            ckpt = f.get_tensor(key).float()
        sizes = [n for _, n in group_parts(regroup, cfg)]
        assert sizes == ([dk, dk, r * dv, r * dv] if name == "in_proj_qkvz" else [r, r])
        parts = ckpt.view(hk, sum(sizes), -1).split(sizes, dim=1)
        want = torch.cat([p.reshape(-1, ckpt.shape[1]) for p in parts])
        assert torch.equal(module.weight, want), f"{name}: stored rows are not the checkpoint's, part-major"


def test_fp8_scales_that_cannot_move_with_their_rows_are_named(model_dir, tmp_path):
    """An FP8 in_proj_qkvz whose parts (128 rows each in the tiny model) are not whole row blocks (block 256
    here) cannot have its scales regrouped: the CheckpointError names the tensor, the dims and the block."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_fp8_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_fp8_checkpoint", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dst = tmp_path / "fp8"
    mod.make_fp8_checkpoint(model_dir, dst)
    cfg_path = dst / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["quantization_config"]["weight_block_size"] = [256, 128]
    cfg_path.write_text(json.dumps(raw))
    cfg = Qwen3NextConfig.from_hf(dst)
    kern = select_kernels("cpu", torch.float32, backend="reference")
    target = Qwen3NextForCausalLM(cfg, DenseCoreFactory(kern), kern)
    with pytest.raises(CheckpointError) as e:
        load_target(target, dst)
    msg = str(e.value)
    want = (
        "tensor model.layers.0.linear_attn.in_proj_qkvz.weight: its rows are regrouped part-major on load "
        "(weight_map regroup), which moves the FP8 block scales in whole blocks of 256 rows, but "
        "q: linear_key_head_dim=128, k: linear_key_head_dim=128 are not a multiple of 256 (weight_block_size)"
    )  # v and z are (Hv/Hk) * 128 = 256 rows: whole blocks
    assert cfg.linear_key_head_dim == 128 and cfg.linear_value_head_dim == 128
    assert want in msg, msg[:3000]
    assert "dequantize_fp8=True" in msg
