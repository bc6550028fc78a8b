"""The bundled model in bf16 on the cpu kernels with its linears' weights packed once
(``hold_packed_linears``): the packed product runs (spied) and the target's logits are bit-equal to the
unpacked model's; float32 and backends without packed weights are left as they are."""

from __future__ import annotations

import pytest
import torch
from atom_core import Qwen3NextConfig
from atom_kernels import select_kernels
from atom_kernels.ops.linear import cpu as linear_cpu
from atom_models import DenseContext, DenseCoreFactory, Qwen3NextForCausalLM, hold_packed_linears, load_target
from atom_models.parallel.linear import Linear


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


@pytest.mark.skipif(not linear_cpu.packing_available(), reason="oneDNN has no bf16 linear on this CPU")
def test_packed_linears_bit_equal_and_used(model_dir, monkeypatch):
    model, kernels = _target(model_dir, torch.bfloat16)
    before = _logits(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    wide = [m for m in linears if m.weight.shape[0] >= linear_cpu.PACK_MIN_ROWS]
    added = hold_packed_linears(model, kernels)
    assert added == sum(m.weight.numel() * 2 for m in wide) > 0
    assert all(m.packed is not None for m in wide)
    assert all(m.packed is None for m in linears if m not in wide)  # in_proj_ba, the gates: F.linear

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
