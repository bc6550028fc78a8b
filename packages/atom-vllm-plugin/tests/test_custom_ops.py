"""The plugin's vLLM custom ops: traceable by Dynamo in one graph (what vLLM's support_torch_compile needs),
and the same numbers through the op as through the direct call.

1. A MoE block (router traced, experts through ``vllm::atom_moe_experts``) compiled with
   ``fullgraph=True`` equals the eager block; a graph break (the reference experts group tokens on the
   host) would raise instead.
2. ``AtomAttentionCore.forward`` goes through ``vllm::atom_attention_with_output``: under
   ``torch.compile(fullgraph=True)`` the op stays one opaque call, and with this step's metadata (the op
   finds it, as in vLLM, through the forward context) it writes what ``run(md, ...)`` returns, with zeros in
   the padding rows after the real tokens.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from atom_core import Qwen3NextConfig  # noqa: E402
from atom_kernels import select_kernels  # noqa: E402
from atom_models.moe import SparseMoeBlock  # noqa: E402
from atom_models.testing import tiny_config  # noqa: E402
from atom_vllm_plugin.layers import attention as attention_mod  # noqa: E402
from atom_vllm_plugin.layers import custom_ops  # noqa: E402
from atom_vllm_plugin.layers.attention import AtomAttentionCore  # noqa: E402
from atom_vllm_plugin.layers.attention_backend import AtomAttentionMetadata  # noqa: E402


def _moe_config() -> Qwen3NextConfig:
    return tiny_config(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    )


def test_moe_block_compiles_in_one_graph_and_matches_eager():
    torch.manual_seed(0)
    kern = select_kernels("cpu", torch.float32, backend="reference")
    block = SparseMoeBlock(_moe_config(), custom_ops.compilable_kernels(kern), dtype=torch.float32)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(5, 32)
    direct = SparseMoeBlock(_moe_config(), kern, dtype=torch.float32)
    direct.load_state_dict(block.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="eager", dynamic=True)
    with torch.no_grad():
        want = direct(x)
        got = compiled(x)
        got7 = compiled(torch.randn(7, 32))  # another token count: the same dynamic graph
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got7.shape == (7, 32)


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
