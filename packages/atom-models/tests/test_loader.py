"""Checkpoint loading: streaming into stacked/fused parameters, and ONE CheckpointError listing every problem."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from atom_core import Qwen3NextConfig
from atom_kernels import select_kernels
from atom_models import (
    CheckpointError,
    DenseCoreFactory,
    Qwen3NextForCausalLM,
    Qwen3NextMTP,
    load_mtp,
    load_target,
    loader,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def _build(ckpt, kernels):
    cfg = Qwen3NextConfig.from_hf(ckpt)
    target = Qwen3NextForCausalLM(cfg, DenseCoreFactory(kernels), kernels)
    mtp = Qwen3NextMTP(cfg, DenseCoreFactory(kernels), kernels, target.model.embed_tokens, target.lm_head)
    return target, mtp


def _all_tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _single_file_copy(model_dir, dst, edit=None):
    """Copy the fixture as ONE model.safetensors, after ``edit(tensors)``."""
    dst.mkdir()
    shutil.copy(model_dir / "config.json", dst / "config.json")
    tensors = _all_tensors(model_dir)
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _shared_equals_expert_copy(model_dir, dst, edit=None):
    """The fixture with its shared expert cut to the experts' intermediate size (Is = I = 64: the first 64
    gate / up rows and down columns), so its MoE blocks fold the shared expert in as one pseudo-expert."""
    cfg = json.loads((model_dir / "config.json").read_text())
    inter = cfg["moe_intermediate_size"]

    def cut(t):
        for name in list(t):
            if ".shared_expert." in name:
                t[name] = (
                    t[name][:, :inter] if name.endswith("down_proj.weight") else t[name][:inter]
                ).clone()
        if edit is not None:
            edit(t)

    _single_file_copy(model_dir, dst, cut)
    (dst / "config.json").write_text(json.dumps({**cfg, "shared_expert_intermediate_size": inter}))
    return dst


def test_loads_the_shared_expert_folded_in(model_dir, tmp_path, kernels32):
    """Is = I: the shared expert's gate / up rows and down columns are pseudo-expert E, its gate row the
    router's row E, repeated up to a multiple of 8 rows (target layers and the MTP layer)."""
    ckpt = _shared_equals_expert_copy(model_dir, tmp_path / "ck")
    target, mtp = _build(ckpt, kernels32)
    load_target(target, ckpt)
    load_mtp(mtp, ckpt)
    f = load_file(str(ckpt / "model.safetensors"))
    for pre, moe in (
        ("model.layers.2.mlp.", target.model.layers[2].mlp),
        ("mtp.layers.0.mlp.", mtp.layers["4"].mlp),
    ):
        e = moe.experts.num_experts
        assert moe.num_shared == 1 and moe.shared_expert is None and moe.experts.w13.shape[0] == e + 1
        inter = moe.experts.w2.shape[2]
        assert torch.equal(moe.experts.w13[e, :inter], f[pre + "shared_expert.gate_proj.weight"])
        assert torch.equal(moe.experts.w13[e, inter:], f[pre + "shared_expert.up_proj.weight"])
        assert torch.equal(moe.experts.w2[e], f[pre + "shared_expert.down_proj.weight"])
        assert torch.equal(moe.gate.weight[:e], f[pre + "gate.weight"])
        rest = moe.gate.weight[e:]
        assert rest.shape[0] == 8 - e % 8 and torch.equal(
            rest, f[pre + "shared_expert_gate.weight"].expand_as(rest)
        )


def test_loads_stacked_experts_and_fused_rows(model_dir, kernels32):
    target, mtp = _build(model_dir, kernels32)
    assert load_target(target, model_dir) == 154
    assert load_mtp(mtp, model_dir) == 41  # embedding and lm_head are not read again
    files = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]

    def tensor(name):
        with safe_open(str(model_dir / files[name]), framework="pt") as f:
            return f.get_tensor(name).float()

    moe = target.model.layers[2].mlp
    inter = moe.experts.w2.shape[-1]
    assert torch.equal(moe.experts.w13[5, :inter], tensor("model.layers.2.mlp.experts.5.gate_proj.weight"))
    assert torch.equal(moe.experts.w13[5, inter:], tensor("model.layers.2.mlp.experts.5.up_proj.weight"))
    assert torch.equal(moe.experts.w2[7], tensor("model.layers.2.mlp.experts.7.down_proj.weight"))
    shared = moe.shared_expert.gate_up_proj.weight  # Is = 2 I: the unfused shared expert
    assert moe.num_shared == 0 and moe.gate.weight.shape[0] == moe.experts.num_experts
    assert torch.equal(
        shared[shared.shape[0] // 2 :], tensor("model.layers.2.mlp.shared_expert.up_proj.weight")
    )
    # mtp.layers.0 lands in the layer with absolute index num_hidden_layers (4)
    # q_proj / k_proj / v_proj are the rows [q | k | v] of the fused qkv_proj
    qkv = mtp.layers["4"].self_attn.qkv_proj.weight
    q, k, v = (tensor(f"mtp.layers.0.self_attn.{p}_proj.weight") for p in "qkv")
    assert q.shape[0] != k.shape[0] and torch.equal(qkv, torch.cat([q, k, v]))
    assert torch.equal(mtp.fc.weight, tensor("mtp.fc.weight"))


def test_missing_mtp_tensor_is_named(model_dir, tmp_path, kernels32):
    ckpt = _single_file_copy(
        model_dir, tmp_path / "ck", lambda t: t.pop("mtp.layers.0.mlp.experts.3.up_proj.weight")
    )
    target, mtp = _build(ckpt, kernels32)
    load_target(target, ckpt)  # the target does not care about mtp.*
    with pytest.raises(CheckpointError) as e:
        load_mtp(mtp, ckpt)
    print(e.value)
    assert len(e.value.problems) == 1
    assert "missing tensor mtp.layers.0.mlp.experts.3.up_proj.weight" in e.value.problems[0]


def test_all_problems_in_one_error_with_file_names(model_dir, tmp_path, kernels32):
    def edit(t):
        t.pop("model.layers.1.linear_attn.A_log")
        t["model.layers.0.mlp.experts.1.down_proj.weight"] = torch.zeros(3, 3)
        t["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(64, 256)  # only 8 experts
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(4, 4)  # layer 0 is linear attention
        t["model.bogus.weight"] = torch.zeros(1)

    ckpt = _single_file_copy(model_dir, tmp_path / "ck", edit)
    target, _ = _build(ckpt, kernels32)
    with pytest.raises(CheckpointError) as e:
        load_target(target, ckpt)
    msg = str(e.value)
    print(msg)
    assert len(e.value.problems) == 5
    assert "missing tensor model.layers.1.linear_attn.A_log" in msg
    assert (
        "tensor model.layers.0.mlp.experts.1.down_proj.weight in model.safetensors has shape [3, 3], expected [256, 64]"
        in msg
    )
    for name in (
        "model.layers.0.mlp.experts.8.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.bogus.weight",
    ):
        assert f"unexpected tensor {name} in model.safetensors" in msg


def test_folded_shared_expert_problems_name_tensor_file_and_shape(model_dir, tmp_path, kernels32):
    """The folded shared expert's tensors (Is = I) and the shared gate row (the router's row E) are checked
    like any other: wrong shape, missing, each named once."""

    def edit(t):
        t["model.layers.1.mlp.shared_expert.up_proj.weight"] = torch.zeros(96, 256)
        t["model.layers.2.mlp.shared_expert.down_proj.weight"] = torch.zeros(256, 32)
        t.pop("model.layers.3.mlp.shared_expert_gate.weight")

    ckpt = _shared_equals_expert_copy(model_dir, tmp_path / "ck", edit)
    target, _ = _build(ckpt, kernels32)
    with pytest.raises(CheckpointError) as e:
        load_target(target, ckpt)
    print(e.value)
    assert e.value.problems == [
        "tensor model.layers.1.mlp.shared_expert.up_proj.weight in model.safetensors has shape [96, 256], "
        "expected [64, 256] (for model.layers.1.mlp.experts.w13, the shared expert folded in)",
        "tensor model.layers.2.mlp.shared_expert.down_proj.weight in model.safetensors has shape [256, 32], "
        "expected [256, 64] (for model.layers.2.mlp.experts.w2, the shared expert folded in)",
        f"missing tensor model.layers.3.mlp.shared_expert_gate.weight (for model.layers.3.mlp.gate.weight) in {ckpt}",
    ]


def test_wrong_shape_in_sharded_checkpoint_names_the_shard(model_dir, tmp_path, kernels32):
    ckpt = tmp_path / "ck"
    shutil.copytree(model_dir, ckpt)
    mtp_file = ckpt / "model-mtp.safetensors"
    tensors = load_file(str(mtp_file))
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :256].contiguous()
    save_file(tensors, str(mtp_file))
    target, mtp = _build(ckpt, kernels32)
    with pytest.raises(
        CheckpointError,
        match=r"mtp.fc.weight in model-mtp.safetensors has shape \[256, 256\], expected \[256, 512\]",
    ):
        load_mtp(mtp, ckpt)


def test_index_naming_absent_file(model_dir, tmp_path, kernels32):
    ckpt = tmp_path / "ck"
    shutil.copytree(model_dir, ckpt)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    target, _ = _build(model_dir, kernels32)
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which does not exist"):
        load_target(target, ckpt)


def test_non_finite_weights_are_refused_by_name(model_dir, tmp_path, kernels32):
    def edit(t):
        t["model.layers.2.mlp.experts.5.down_proj.weight"][3, 7] = float("nan")
        t["model.norm.weight"][0] = float("inf")
        t["mtp.fc.weight"][1, 1] = float("-inf")

    ckpt = _single_file_copy(model_dir, tmp_path / "ck", edit)
    target, mtp = _build(ckpt, kernels32)
    with pytest.raises(CheckpointError) as e:
        load_target(target, ckpt)
    print(e.value)
    assert sorted(e.value.problems) == [
        f"tensor model.layers.2.mlp.experts.5.down_proj.weight in model.safetensors has 1 NaN and 0 Inf values "
        f"(as torch.float32) in {ckpt}",
        f"tensor model.norm.weight in model.safetensors has 0 NaN and 1 Inf values (as torch.float32) in {ckpt}",
    ]
    with pytest.raises(
        CheckpointError, match=r"tensor mtp.fc.weight in model.safetensors has 0 NaN and 1 Inf"
    ):
        load_mtp(mtp, ckpt)


def test_weight_that_overflows_the_model_dtype_is_refused(model_dir, tmp_path, kernels32):
    ckpt = _single_file_copy(
        model_dir, tmp_path / "ck", lambda t: t["model.norm.weight"].__setitem__(0, 1e39)
    )
    cfg = Qwen3NextConfig.from_hf(ckpt)  # the checkpoint holds float32 here; the model is bfloat16
    target = Qwen3NextForCausalLM(cfg, DenseCoreFactory(kernels32), kernels32).to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"model.norm.weight in model.safetensors has 0 NaN and 1 Inf"):
        load_target(target, ckpt)


def test_large_finite_weights_are_accepted(model_dir, tmp_path, kernels32):
    """A tensor whose float32 sum overflows but whose values are finite is not a problem."""
    ckpt = _single_file_copy(model_dir, tmp_path / "ck", lambda t: t["model.norm.weight"].fill_(3e38))
    target, _ = _build(ckpt, kernels32)
    assert load_target(target, ckpt) == 154


@pytest.mark.parametrize("keep", [8, 200, -100])
def test_truncated_shard_is_named(model_dir, tmp_path, kernels32, keep):
    """Cut inside the header length, inside the header, and inside the tensor data."""
    ckpt = tmp_path / "ck"
    shutil.copytree(model_dir, ckpt)
    shard = ckpt / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:keep] if keep > 0 else data[:keep])
    target, _ = _build(model_dir, kernels32)
    with pytest.raises(CheckpointError) as e:
        load_target(target, ckpt)
    print(e.value)
    assert "file model-00002-of-00002.safetensors cannot be read" in str(e.value)
    assert f"({len(data[:keep])} bytes" in str(e.value)
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors cannot be read"):
        loader.check_files(ckpt)


def test_index_that_is_not_json_is_named(model_dir, tmp_path, kernels32):
    ckpt = tmp_path / "ck"
    shutil.copytree(model_dir, ckpt)
    index = ckpt / "model.safetensors.index.json"
    index.write_text(index.read_text()[:100])
    target, _ = _build(model_dir, kernels32)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not valid JSON"):
        load_target(target, ckpt)


def _fp8_block_quant(w: torch.Tensor, block=(128, 128)):
    """Test-data generator: e4m3 weight + ``[ceil(N/bn), ceil(K/bk)]`` scales with absmax/448 per block."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).view(rows * bn, cols * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


# The published FP8 checkpoint keeps these in bf16 (modules_to_not_convert)
_NOT_FP8 = (
    "embed_tokens",
    "lm_head",
    "norm",
    "mlp.gate.weight",
    "shared_expert_gate",
    "mtp.fc",
    "conv1d",
    "A_log",
    "dt_bias",
)


def test_fp8_block_checkpoint_is_dequantised_on_load(model_dir, tmp_path, kernels32, golden, monkeypatch):
    quantised = []

    # layer 0's router and shared gate quantised too: both are dequantised on load
    routers = ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight")

    def edit(t):
        for name in list(t):
            w = t[name]
            fp8 = not any(s in name for s in _NOT_FP8) or name in routers
            if w.dim() == 2 and name.endswith(".weight") and fp8:
                t[name], t[name + "_scale_inv"] = _fp8_block_quant(w)
                quantised.append(name)

    ckpt = _single_file_copy(model_dir, tmp_path / "ck", edit)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": list(_NOT_FP8),
    }
    (ckpt / "config.json").write_text(json.dumps(raw))
    target, mtp = _build(ckpt, kernels32)
    opened = []

    def counting_open(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return safe_open(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", counting_open)
    load_target(target, ckpt, dequantize_fp8=True)
    load_mtp(mtp, ckpt, dequantize_fp8=True)
    # per load: the key listing, the header pass and the tensor pass (not one open per FP8 scale)
    assert opened == ["model.safetensors"] * 6, opened
    assert len(quantised) == 154  # every expert, attention, GDN and shared-expert projection, 2 routers
    f = load_file(str(ckpt / "model.safetensors"))

    def dequant(name):
        return kernels32.fp8_block_dequant(
            f[name], f[name + "_scale_inv"], block=(128, 128), dtype=torch.float32
        )

    # the unfused shared expert (Is = 2 I) and both routers (quantised here) come back dequantised
    moe = target.model.layers[2].mlp
    assert torch.equal(
        moe.shared_expert.down_proj.weight, dequant("model.layers.2.mlp.shared_expert.down_proj.weight")
    )
    layer0 = target.model.layers[0].mlp
    assert torch.equal(layer0.gate.weight, dequant(routers[0]))
    assert torch.equal(layer0.shared_expert_gate.weight, dequant(routers[1]))
    want = kernels32.fp8_block_dequant(
        f["model.layers.1.mlp.experts.6.up_proj.weight"],
        f["model.layers.1.mlp.experts.6.up_proj.weight_scale_inv"],
        block=(128, 128),
        dtype=torch.float32,
    )
    assert torch.equal(target.model.layers[1].mlp.experts.w13[6, 64:], want)
    assert torch.equal(
        mtp.layers["4"].self_attn.o_proj.weight,
        kernels32.fp8_block_dequant(
            f["mtp.layers.0.self_attn.o_proj.weight"],
            f["mtp.layers.0.self_attn.o_proj.weight_scale_inv"],
            block=(128, 128),
            dtype=torch.float32,
        ),
    )
    # FP8 weights are close to the bf16 ones: greedy next tokens of the golden rows mostly agree
    ids = golden["input_ids"][0]
    with torch.no_grad():
        logits = target.compute_logits(target(ids, torch.arange(ids.shape[0])))
    agree = (logits.argmax(-1) == golden["target_logits"][0].argmax(-1)).float().mean().item()
    print(f"FP8 vs float32 reference: argmax agreement {agree:.3f}")
    assert agree > 0.85


def test_fp8_weight_without_scale_is_reported(model_dir, tmp_path, kernels32):
    def edit(t):
        name = "model.layers.0.linear_attn.out_proj.weight"
        t[name], _ = _fp8_block_quant(t[name])
        t["model.layers.0.mlp.shared_expert.down_proj.weight_scale_inv"] = torch.ones(3, 3)

    ckpt = _single_file_copy(model_dir, tmp_path / "ck", edit)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(raw))
    target, _ = _build(ckpt, kernels32)
    with pytest.raises(CheckpointError) as e:
        load_target(target, ckpt)
    msg = str(e.value)
    assert "model.layers.0.linear_attn.out_proj.weight in model.safetensors is FP8 but" in msg
    assert (
        "model.layers.0.mlp.shared_expert.down_proj.weight_scale_inv in model.safetensors has shape [3, 3], expected [2, 1]"
        in msg
    )


def test_checkpoint_without_mtp(model_dir, tmp_path, kernels32):
    ckpt = _single_file_copy(
        model_dir, tmp_path / "ck", lambda t: [t.pop(k) for k in [k for k in t if k.startswith("mtp.")]]
    )
    target, mtp = _build(ckpt, kernels32)
    load_target(target, ckpt)
    with pytest.raises(CheckpointError, match="no mtp"):
        load_mtp(mtp, ckpt)


def test_bf16_model_keeps_a_float32_a_log(model_dir, tmp_path):
    """A bf16 model reads a float32 checkpoint's GDN ``A_log`` unrounded (stock vLLM keeps it float32 too:
    exp(A_log) scales every decay); the other GDN parameters take the model dtype."""
    gen = torch.Generator().manual_seed(0)

    def edit(t):
        for name in [n for n in t if n.endswith("linear_attn.A_log")]:
            t[name] = torch.log(1 + 15 * torch.rand(t[name].shape, generator=gen))  # not bf16-representable

    ckpt = _single_file_copy(model_dir, tmp_path / "ck", edit)
    kernels = select_kernels("cpu", torch.bfloat16)
    target, _ = _build(ckpt, kernels)
    load_target(target, ckpt)
    stored = load_file(str(ckpt / "model.safetensors"))
    gdn = [
        (i, layer.linear_attn) for i, layer in enumerate(target.model.layers) if hasattr(layer, "linear_attn")
    ]
    assert gdn
    for i, attn in gdn:
        assert attn.A_log.dtype == torch.float32 and attn.dt_bias.dtype == torch.bfloat16
        assert torch.equal(attn.A_log, stored[f"model.layers.{i}.linear_attn.A_log"])
