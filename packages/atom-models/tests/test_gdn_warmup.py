"""warm_up_prefill: every prefill path (fresh prompts, continuing chunks, the pending-token resume) runs
on scratch state only, for each warm-up batch that fits the given activations."""

from __future__ import annotations

import pytest
import torch
from atom_kernels import select_kernels
from atom_models import gdn_warmup
from atom_models.gdn_state import GDNGeometry, GDNLayerState
from atom_models.gdn_warmup import WARMUP_BATCHES, warm_up_prefill
from atom_models.testing import random_gdn_layer, tiny_config


@pytest.mark.parametrize("k", [0, 2])
def test_warm_up_runs_each_batch_fresh_then_continuing(k, monkeypatch):
    torch.manual_seed(0)
    cfg = tiny_config()
    kern = select_kernels("cpu", torch.float32, backend="reference")
    layer = random_gdn_layer(cfg, kern)
    geo = GDNGeometry.from_config(cfg, k)
    metas, states = [], []
    real = gdn_warmup.gdn_prefill

    def spy(kernels, geometry, weights, state, x, b, a, meta):
        metas.append(meta)
        return real(kernels, geometry, weights, state, x, b, a, meta)

    def make_state(n: int) -> GDNLayerState:
        states.append(
            GDNLayerState.allocate(geo, n, conv_dtype=torch.float32, ssm_dtype=torch.float32, device="cpu")
        )
        return states[-1]

    monkeypatch.setattr(gdn_warmup, "gdn_prefill", spy)
    t = 120
    x, b, a = torch.randn(t, layer.conv_dim), torch.randn(t, geo.num_v_heads), torch.randn(t, geo.num_v_heads)
    calls = warm_up_prefill(kern, geo, layer.gdn_weights(), x, b, a, make_state)
    assert calls == 2 * len(WARMUP_BATCHES) == len(metas)
    assert [m.has_initial_state.all().item() for m in metas] == [False, True] * len(WARMUP_BATCHES)
    assert [m.resume_pending for m in metas] == [False, k > 0] * len(WARMUP_BATCHES)
    for s, lens in zip(states, WARMUP_BATCHES, strict=True):
        assert s.ssm.abs().sum() > 0  # the scratch state was written
        if k:  # one pending token resumed, then each slot's pending_pos = 2 * len - 1
            assert s.pending_pos[:, 0].tolist() == [2 * n - 1 for n in lens]


def test_batches_longer_than_the_activations_are_skipped():
    cfg = tiny_config()
    kern = select_kernels("cpu", torch.float32, backend="reference")
    layer = random_gdn_layer(cfg, kern)
    geo = GDNGeometry.from_config(cfg, 1)
    x, b, a = torch.randn(3, layer.conv_dim), torch.randn(3, geo.num_v_heads), torch.randn(3, geo.num_v_heads)

    def make_state(n):
        return GDNLayerState.allocate(geo, n, conv_dtype=torch.float32, ssm_dtype=torch.float32, device="cpu")

    assert warm_up_prefill(kern, geo, layer.gdn_weights(), x, b, a, make_state) == 2  # only the 1-token batch
