"""A checkpoint with two MTP layers: absolute indices, spec_step % num_mtp_layers, engine still lossless."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from atom_core import Qwen3NextConfig
from atom_models import (
    CheckpointError,
    DenseCoreFactory,
    Qwen3NextForCausalLM,
    Qwen3NextMTP,
    load_mtp,
    load_target,
)
from atom_models.engine import EngineConfig, LLMEngine, SamplingParams
from safetensors.torch import load_file, save_file


def _two_mtp_layers(model_dir, dst, drop: str | None = None):
    """The fixture with ``mtp_num_hidden_layers: 2``; ``mtp.layers.1`` is a perturbed copy of layer 0."""
    shutil.copytree(model_dir, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 2
    (dst / "config.json").write_text(json.dumps(raw))
    mtp_file = dst / "model-mtp.safetensors"
    tensors = load_file(str(mtp_file))
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.startswith("mtp.layers.0.")]:
        t = tensors[name]
        tensors[name.replace("mtp.layers.0.", "mtp.layers.1.")] = (
            t.float() * (1 + 0.2 * torch.randn(t.shape, generator=gen))
        ).to(t.dtype)
    if drop is not None:
        tensors.pop(drop)
    save_file(tensors, str(mtp_file))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: "model-mtp.safetensors" for n in tensors} | {
        n: f for n, f in index["weight_map"].items() if not n.startswith("mtp.")
    }
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_spec_step_selects_layer_modulo(model_dir, tmp_path, kernels32):
    ckpt = _two_mtp_layers(model_dir, tmp_path / "ck")
    cfg = Qwen3NextConfig.from_hf(ckpt)
    target = Qwen3NextForCausalLM(cfg, DenseCoreFactory(kernels32), kernels32)
    mtp = Qwen3NextMTP(cfg, DenseCoreFactory(kernels32), kernels32, target.model.embed_tokens, target.lm_head)
    load_target(target, ckpt)
    load_mtp(mtp, ckpt)
    assert list(mtp.layers.keys()) == ["4", "5"]
    assert [mtp.layer_for_step(s).layer_idx for s in range(4)] == [4, 5, 4, 5]
    ran = []
    for key in ("4", "5"):
        mtp.layers[key].register_forward_hook(lambda m, i, o, key=key: ran.append(key))
    ids, h = torch.tensor([5, 9, 11]), torch.randn(3, cfg.hidden_size)
    with torch.no_grad():
        outs = [mtp(ids, torch.arange(3), h, None, spec_step=s) for s in range(3)]
    assert ran == ["4", "5", "4"]
    assert torch.equal(outs[0], outs[2]) and not torch.allclose(outs[0], outs[1])


def test_missing_tensor_of_second_mtp_layer_is_named(model_dir, tmp_path, kernels32):
    ckpt = _two_mtp_layers(model_dir, tmp_path / "ck", drop="mtp.layers.1.self_attn.k_norm.weight")
    cfg = Qwen3NextConfig.from_hf(ckpt)
    target = Qwen3NextForCausalLM(cfg, DenseCoreFactory(kernels32), kernels32)
    mtp = Qwen3NextMTP(cfg, DenseCoreFactory(kernels32), kernels32, target.model.embed_tokens, target.lm_head)
    with pytest.raises(
        CheckpointError, match=r"missing tensor mtp.layers.1.self_attn.k_norm.weight \(for layers.5"
    ):
        load_mtp(mtp, ckpt)


def test_engine_with_two_mtp_layers_stays_lossless(model_dir, tmp_path, greedy_cases):
    ckpt = _two_mtp_layers(model_dir, tmp_path / "ck")
    eng = LLMEngine.from_pretrained(
        ckpt, EngineConfig(num_speculative_tokens=3, max_model_len=256, max_num_seqs=4)
    )
    assert sorted(eng.caches.kv) == [3, 4, 5]  # target full-attention layer 3, MTP layers 4 and 5
    cases = greedy_cases["cases"][:3]
    res = eng.generate([c["prompt_ids"] for c in cases], SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.output_ids for r in res] == [c["greedy_ids"][:32] for c in cases]
    assert sum(r.stats.num_accepted_tokens for r in res) > 0
