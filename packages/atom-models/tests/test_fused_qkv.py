"""The attention's fused ``qkv_proj`` loaded from HF's separate q/k/v tensors when a part is not a multiple of
the FP8 block's rows (k / v of 64 rows with 128-row blocks): each part keeps its own block-scale rows and
the layer multiplies part by part; its output equals the three separate FP8 linears exactly, at TP = 1 and
on each rank of TP = 2 (KV head replicated)."""

from __future__ import annotations

import json

import pytest
import torch
from atom_models import DenseCoreFactory, Qwen3NextForCausalLM, load_target
from atom_models.modules import Fp8Linear
from atom_models.parallel import RankWithoutGroup
from atom_models.testing import tiny_config
from safetensors.torch import save_file

H, HQ, HKV, D, FF, V = 128, 2, 1, 64, 128, 64
QUANT = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
    "modules_to_not_convert": ["mlp", "o_proj"],
}  # fmt: skip
HF = {
    "hidden_size": H, "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D,
    "intermediate_size": FF, "vocab_size": V, "layer_types": ["full_attention"], "quantization_config": QUANT,
}  # fmt: skip


def _fp8(rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(rows, H, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, torch.rand(-(-rows // 128), 1, generator=g) * 1e-3 + 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(V, H, generator=g), "lm_head.weight": torch.randn(V, H)}
    t["model.norm.weight"] = torch.zeros(H)
    p = "model.layers.0."
    for n in ("input_layernorm", "post_attention_layernorm"):
        t[p + n + ".weight"] = torch.zeros(H)
    for n, rows in (("q", HQ * 2 * D), ("k", HKV * D), ("v", HKV * D)):
        t[f"{p}self_attn.{n}_proj.weight"], t[f"{p}self_attn.{n}_proj.weight_scale_inv"] = _fp8(rows, g)
    t[p + "self_attn.o_proj.weight"] = torch.randn(H, HQ * D, generator=g) * 0.02
    t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = torch.zeros(D), torch.zeros(D)
    for n, shape in (("gate_proj", (FF, H)), ("up_proj", (FF, H)), ("down_proj", (H, FF))):
        t[f"{p}mlp.{n}.weight"] = torch.randn(*shape, generator=g) * 0.02
    d = tmp_path_factory.mktemp("qkv") / "tiny-qkv-fp8"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_next", **HF}))
    return d, t


@pytest.mark.parametrize("rank,world", [(0, 1), (0, 2), (1, 2)])
def test_unaligned_fp8_qkv_equals_three_separate_linears(ckpt, kernels32, rank, world):
    d, t = ckpt
    cfg = tiny_config(**HF)
    kw = {} if world == 1 else {"parallel": RankWithoutGroup(rank, world)}
    model = Qwen3NextForCausalLM(cfg, DenseCoreFactory(kernels32), kernels32, **kw)
    load_target(model, d)
    qkv = model.model.layers[0].self_attn.qkv_proj
    q_rows = HQ * 2 * D // world
    assert isinstance(qkv, Fp8Linear) and qkv.row_parts == (q_rows, D, D)
    assert qkv.part_spans is not None  # k is not whole 128-row blocks: part by part
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    want = []
    for n, (s, e) in (("q", (rank * q_rows, (rank + 1) * q_rows)), ("k", (0, D)), ("v", (0, D))):
        w, sc = (
            t[f"model.layers.0.self_attn.{n}_proj.weight"],
            t[f"model.layers.0.self_attn.{n}_proj.weight_scale_inv"],
        )
        want.append(kernels32.fp8_linear(x, w[s:e], sc[s // 128 : -(-e // 128)], (128, 128), None))
    assert torch.equal(qkv(x), torch.cat(want, -1))
