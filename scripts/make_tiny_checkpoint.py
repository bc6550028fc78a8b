"""Make a random Qwen3-Next checkpoint with its MTP head, in the bundled model's file layout, float32 weights.

    uv run --no-sync python scripts/make_tiny_checkpoint.py OUT_DIR --seed 1 [--hidden 384 --layers 8 ...]

The bundled model (``data/tiny-qwen3-next-mtp``) is trained and stored in bf16, so bf16 serving reads its
weights exactly. A checkpoint from this script has float32 weights drawn from a seeded generator: bf16
serving casts every weight, and each seed and size is a model nobody tuned a tolerance on. Layout as the
published checkpoints: per-expert ``gate_proj`` / ``up_proj`` / ``down_proj``, the ``mtp.*`` tensors in
``model-mtp.safetensors``, ``model.safetensors.index.json``; ``config.json`` is the bundled model's with the
sizes replaced; the tokenizer and generation files are copied from the bundled model (vocabulary 4096).

Initialisation (seeded ``torch.Generator``, independent of any library's init): every linear weight and
the conv1d taps ~ N(0, 1/fan_in) (unit-scale activations, so bf16 rounding is relative, as in a trained
model), except the projections that write into the residual stream (``o_proj``, ``out_proj``, the experts'
and shared expert's ``down_proj``), ~ N(0, out_gain^2/fan_in) with ``--out-gain`` 0.25: at gain 1 the
random layers amplify rounding so much that bf16 serving leaves the float32 argmax on ~12% of
teacher-forced tokens (0.25: ~2%, the bundled trained model's rate); embeddings ~ N(0, 1); ``lm_head`` ~ N(0, (logit_std^2)/H), so that the logits of a unit-RMS hidden
state have spread ``--logit-std`` (the default, 3, puts the best-vs-second margin around one logit, where
near-ties happen at a trained model's rate); zero-centred norm weights (``x * (1 + w)``) ~ N(0, 0.1^2);
GDN ``A_log = log(U(1, 16))`` and ``dt_bias = softplus^-1(dt)`` with ``log dt ~ U(log 1e-3, log 1e-1)``.
Head dims stay 128 (vLLM's CPU backends need them), the layers follow the 3:1 GDN:attention rhythm.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "tiny-qwen3-next-mtp"
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
HEAD_DIM = 128


def make_config(base: dict, a: argparse.Namespace) -> dict:
    """The bundled config with this checkpoint's sizes (float32 weights)."""
    cfg = dict(base)
    cfg.update(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(a.layers)],
        num_attention_heads=a.attn_heads,
        num_key_value_heads=a.kv_heads,
        head_dim=HEAD_DIM,
        linear_num_key_heads=a.gdn_key_heads,
        linear_num_value_heads=a.gdn_value_heads,
        linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM,
        num_experts=a.experts,
        num_experts_per_tok=a.top_k,
        moe_intermediate_size=a.moe_intermediate,
        shared_expert_intermediate_size=a.shared_intermediate,
        intermediate_size=2 * a.hidden,
        dtype="float32",
        torch_dtype="float32",
    )
    return cfg


class _Init:
    def __init__(self, seed: int, out_gain: float = 1.0) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.out_gain = out_gain  # the projections that write into the residual stream

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * std

    def linear(self, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return self.normal(out_f, in_f, std=gain / math.sqrt(in_f))

    def norm(self, n: int) -> torch.Tensor:
        return self.normal(n, std=0.1)

    def uniform(self, n: int, lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, generator=self.g)


def _moe(p: str, cfg: dict, r: _Init) -> dict[str, torch.Tensor]:
    h, i, si = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    t = {f"{p}mlp.gate.weight": r.linear(cfg["num_experts"], h)}
    for e in range(cfg["num_experts"]):
        t[f"{p}mlp.experts.{e}.gate_proj.weight"] = r.linear(i, h)
        t[f"{p}mlp.experts.{e}.up_proj.weight"] = r.linear(i, h)
        t[f"{p}mlp.experts.{e}.down_proj.weight"] = r.linear(h, i, r.out_gain)
    t[f"{p}mlp.shared_expert.gate_proj.weight"] = r.linear(si, h)
    t[f"{p}mlp.shared_expert.up_proj.weight"] = r.linear(si, h)
    t[f"{p}mlp.shared_expert.down_proj.weight"] = r.linear(h, si, r.out_gain)
    t[f"{p}mlp.shared_expert_gate.weight"] = r.linear(1, h)
    t[f"{p}input_layernorm.weight"] = r.norm(h)
    t[f"{p}post_attention_layernorm.weight"] = r.norm(h)
    return t


def _attention(p: str, cfg: dict, r: _Init) -> dict[str, torch.Tensor]:
    h, q, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {
        f"{p}self_attn.q_proj.weight": r.linear(2 * q * HEAD_DIM, h),  # query and its output gate
        f"{p}self_attn.k_proj.weight": r.linear(kv * HEAD_DIM, h),
        f"{p}self_attn.v_proj.weight": r.linear(kv * HEAD_DIM, h),
        f"{p}self_attn.o_proj.weight": r.linear(h, q * HEAD_DIM, r.out_gain),
        f"{p}self_attn.q_norm.weight": r.norm(HEAD_DIM),
        f"{p}self_attn.k_norm.weight": r.norm(HEAD_DIM),
    }


def _gdn(p: str, cfg: dict, r: _Init) -> dict[str, torch.Tensor]:
    h, nk, nv = cfg["hidden_size"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = nk * HEAD_DIM, nv * HEAD_DIM
    k = cfg["linear_conv_kernel_dim"]
    dt = torch.exp(r.uniform(nv, math.log(1e-3), math.log(1e-1)))
    return {
        f"{p}linear_attn.in_proj_qkvz.weight": r.linear(2 * kd + 2 * vd, h),
        f"{p}linear_attn.in_proj_ba.weight": r.linear(2 * nv, h),
        f"{p}linear_attn.conv1d.weight": r.normal(2 * kd + vd, 1, k, std=1.0 / math.sqrt(k)),
        f"{p}linear_attn.A_log": torch.log(r.uniform(nv, 1.0, 16.0)),
        f"{p}linear_attn.dt_bias": dt + torch.log(-torch.expm1(-dt)),  # softplus^-1(dt)
        f"{p}linear_attn.norm.weight": 1.0 + r.norm(HEAD_DIM),  # the gated norm scales by w, not 1 + w
        f"{p}linear_attn.out_proj.weight": r.linear(h, vd, r.out_gain),
    }


def make_tensors(cfg: dict, seed: int, logit_std: float, out_gain: float) -> tuple[dict, dict]:
    """(target tensors, mtp tensors), float32."""
    r, h, v = _Init(seed, out_gain), cfg["hidden_size"], cfg["vocab_size"]
    target = {"model.embed_tokens.weight": r.normal(v, h, std=1.0)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        target.update(_gdn(p, cfg, r) if kind == "linear_attention" else _attention(p, cfg, r))
        target.update(_moe(p, cfg, r))
    target["model.norm.weight"] = r.norm(h)
    target["lm_head.weight"] = r.normal(v, h, std=logit_std / math.sqrt(h))
    mtp = {
        "mtp.fc.weight": r.linear(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": r.norm(h),
        "mtp.pre_fc_norm_hidden.weight": r.norm(h),
        "mtp.norm.weight": r.norm(h),
    }
    for j in range(int(cfg.get("mtp_num_hidden_layers", 1))):
        mtp.update(_attention(f"mtp.layers.{j}.", cfg, r))
        mtp.update(_moe(f"mtp.layers.{j}.", cfg, r))
    return target, mtp


def write(out: Path, cfg: dict, target: dict, mtp: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files = {"model-00001-of-00001.safetensors": target, "model-mtp.safetensors": mtp}
    weight_map, size = {}, 0
    for name, tensors in files.items():
        tensors = {k: t.contiguous() for k, t in tensors.items()}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        size += sum(t.numel() * t.element_size() for t in tensors.values())
    n_target = sum(t.numel() for t in target.values())
    index = {"metadata": {"total_parameters": n_target, "total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in COPIED:
        shutil.copy(BUNDLED / f, out / f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8, help="multiple of 4 keeps the 3:1 rhythm")
    ap.add_argument("--attn-heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--gdn-key-heads", type=int, default=2)
    ap.add_argument("--gdn-value-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-intermediate", type=int, default=96)
    ap.add_argument("--shared-intermediate", type=int, default=192)
    ap.add_argument("--logit-std", type=float, default=3.0)
    ap.add_argument("--out-gain", type=float, default=0.25, help="std scale of the residual-stream writers")
    a = ap.parse_args(argv)
    base = json.loads((BUNDLED / "config.json").read_text())
    cfg = make_config(base, a)
    target, mtp = make_tensors(cfg, a.seed, a.logit_std, a.out_gain)
    write(a.out, cfg, target, mtp)
    n = sum(t.numel() for t in target.values())
    print(
        f"wrote {a.out}: seed {a.seed}, hidden {a.hidden}, {a.layers} layers, {n / 1e6:.2f} M target params"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
