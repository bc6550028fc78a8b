"""The bundled model in bf16 on the cpu kernels with its linears' weights prepared once
(``hold_packed_linears``). Where oneDNN packs bf16 (AVX512-BW/VL/DQ or AVX-NE-CONVERT): the packed product
runs (spied) and the target's logits are bit-equal to the unpacked model's. Elsewhere (and forced, on every
CPU) float32 copies are held beside the weights: the logits are as close to the float32 model's as the bf16
model's are. Packed weights are released (all but a tied one; shown on every CPU with a same-size stand-in
for the packed copy, a clone the patched product multiplies with): what the model reads after packing is only
the packed copy. The MoE router's weight is never prepared; float32 models and backends without prepared
weights are left as they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_core import Qwen3NextConfig
from atom_kernels import select_kernels
from atom_kernels.ops.linear import cpu as linear_cpu
from atom_models import DenseContext, DenseCoreFactory, Qwen3NextForCausalLM, hold_packed_linears, load_target
from atom_models.moe import SparseMoeBlock
from atom_models.parallel import linear as linear_mod
from atom_models.parallel.linear import Linear

needs_packing = pytest.mark.skipif(
    not linear_cpu.packing_supported(torch.bfloat16),
    reason="oneDNN does not pack bf16 linear weights on this CPU (needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)",
)


TOL = {
    # the bf16 target's logits with float32 copies of its linears, their distance from the float32 model's
    # logits over that of the bf16 model on F.linear (24 x 2 tokens of the bundled model); measured on the
    # AVX2 EPYC: max |diff| 0.196 / 0.186 = 1.06, mean 0.02507 / 0.02500 = 1.003
    "float32_form_vs_f_linear": 1.25,
}


def _target(model_dir, dtype):
    kernels = select_kernels("cpu", dtype)
    model = Qwen3NextForCausalLM(Qwen3NextConfig.from_hf(model_dir), DenseCoreFactory(kernels), kernels)
    load_target(model, model_dir)
    return model.eval(), kernels


def _logits(model, t: int = 24, b: int = 2) -> torch.Tensor:
    ids = torch.randint(1, 4000, (b * t,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(ids, torch.arange(t).repeat(b), DenseContext((t,) * b))
        return model.compute_logits(hidden)


def _released(m: Linear) -> bool:
    return m.weight_released and m.weight.untyped_storage().nbytes() <= m.weight.element_size()


@needs_packing
def test_packed_linears_bit_equal_and_used(model_dir, monkeypatch):
    model, kernels = _target(model_dir, torch.bfloat16)
    before = _logits(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    wide = [m for m in linears if m.pack and m.weight.shape[0] >= linear_cpu.PACK_MIN_ROWS]
    added = hold_packed_linears(model, kernels)
    assert added == sum(m.weight.numel() * 2 for m in wide) > 0
    assert all(m.packed is not None and _released(m) for m in wide)
    # in_proj_ba, the shared expert's gate (F.linear) and the MoE router (read by moe_gate_router)
    assert all(m.packed is None and not m.weight_released for m in linears if m not in wide)

    calls = []
    real = linear_cpu._LINEAR_PACKED

    def spy(x, packed, bias, n):
        calls.append(n)
        return real(x, packed, bias, n)

    monkeypatch.setattr(linear_cpu, "_LINEAR_PACKED", spy)
    after = _logits(model)
    assert torch.equal(after, before)
    # one packed product per packed linear: every one is called once by the forward and compute_logits
    assert sorted(calls) == sorted(m.weight.shape[0] for m in wide)


def test_nothing_packed_in_float32_or_without_a_packing_backend(model_dir):
    model, kernels = _target(model_dir, torch.float32)
    assert hold_packed_linears(model, kernels) == 0
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))
    bf16, kernels16 = _target(model_dir, torch.bfloat16)
    reference = type("K", (), {"backends": dict(kernels16.backends, linear="reference")})()
    assert hold_packed_linears(bf16, reference) == 0


def _float32_copies(monkeypatch) -> None:
    """The preparation of a CPU where oneDNN does not pack bf16: float32 copies (on every CPU)."""
    monkeypatch.setattr(linear_cpu, "packing_supported", lambda dtype: False)


def test_float32_copies_where_bf16_is_not_packed(model_dir, monkeypatch):
    """The float32 form: every wide linear holds a float32 copy (twice its bf16 bytes) in place of its
    weight (released: the product reads only the copy); with 48 token rows its logits are as close to the
    float32 model's as the bf16 model's on F.linear are (TOL)."""
    exact = _logits(_target(model_dir, torch.float32)[0]).float()
    model, kernels = _target(model_dir, torch.bfloat16)
    before = (_logits(model).float() - exact).abs()
    _float32_copies(monkeypatch)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    wide = [m for m in linears if m.pack and m.weight.shape[0] >= linear_cpu.PACK_MIN_ROWS]
    added = hold_packed_linears(model, kernels)
    assert added == sum(m.weight.numel() * 4 for m in wide) > 0
    assert all(m.packed.dtype == torch.float32 and m.weight_released for m in wide)
    after = (_logits(model).float() - exact).abs()
    for stat in (torch.max, torch.mean):
        ratio = (stat(after) / stat(before)).item()
        assert ratio <= TOL["float32_form_vs_f_linear"], f"{stat.__name__} |logits - float32|: {ratio:.3f}x"


def _stand_in_packing(monkeypatch) -> None:
    """Packing as a clone of the weight, the packed product as ``F.linear`` on that clone."""
    monkeypatch.setattr(linear_mod, "pack_linear_weight", lambda w: w.detach().clone())
    monkeypatch.setattr(linear_cpu, "_LINEAR_PACKED", lambda x, packed, bias, n: F.linear(x, packed, bias))


def test_packed_weights_release_the_originals(model_dir, monkeypatch):
    """Every packed linear's original weight is released (a one-element stand-in of its shape is left), and
    the logits stay bit-equal: nothing reads a packed linear's original weight after packing. The MoE
    router is not packed and keeps its weight; a second call (a draft sharing the target's lm_head) packs
    nothing again."""
    model, kernels = _target(model_dir, torch.bfloat16)
    before = _logits(model)
    _stand_in_packing(monkeypatch)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    held = {id(m): m.weight.numel() * m.weight.element_size() for m in linears}
    added = hold_packed_linears(model, kernels)
    packed = [m for m in linears if m.packed is not None]
    routers = [m.gate for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert packed and routers and added == sum(held[id(m)] for m in packed)
    assert all(_released(m) and m.weight.shape == m.packed.shape for m in packed)
    assert all(r.packed is None and not r.weight_released for r in routers)
    assert all(not m.weight_released for m in linears if m.packed is None)
    assert torch.equal(_logits(model), before)
    assert hold_packed_linears(model, kernels) == 0
    with pytest.raises(RuntimeError):  # loading into a released weight fails loudly
        packed[0].weight.copy_(torch.ones(packed[0].weight.shape, dtype=torch.bfloat16))


def test_tied_weight_is_packed_but_kept(model_dir, monkeypatch):
    """A weight the model holds in another place too (tied embeddings) is packed but not released."""
    model, kernels = _target(model_dir, torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight
    _stand_in_packing(monkeypatch)
    hold_packed_linears(model, kernels)
    assert model.lm_head.packed is not None and not model.lm_head.weight_released
    assert model.lm_head.weight is model.model.embed_tokens.weight
