"""Make an FP8 block-quantised copy of a bf16 Qwen3-Next checkpoint (with its MTP head), in the layout and
``quantization_config`` of the published Qwen3-Next-80B-A3B-Instruct-FP8.

- ``config.json``: the source's, plus ``quantization_config = {activation_scheme: dynamic, fmt: e4m3,
  quant_method: fp8, weight_block_size: [128, 128], modules_to_not_convert: [...]}`` with the published
  list: ``lm_head``, every GDN layer's ``linear_attn.in_proj_ba``, every layer's ``mlp.gate`` and
  ``mlp.shared_expert_gate``, ``mtp.fc`` and the MTP layers' ``mlp.gate`` / ``mlp.shared_expert_gate``
  (in that order).
- Every other 2-D ``*.weight`` of a linear layer (attention q/k/v/o, GDN in_proj_qkvz / out_proj, routed
  and shared experts, the same in ``mtp.layers``) becomes float8_e4m3fn with ``<name>.weight_scale_inv``
  (float32, ``[ceil(N/128), ceil(K/128)]``, scale = block absmax / 448, so ``w ~= q * scale``);
  embeddings, norms, conv1d, ``A_log``, ``dt_bias`` and the listed modules keep the source dtype.
- Tensors stay in the source's files (same shard names), each scale beside its weight;
  ``model.safetensors.index.json`` is rewritten with the new names and the total size. The tokenizer and
  generation files are copied.

Usage: python packages/atom-models/scripts/make_fp8_checkpoint.py SRC_DIR DST_DIR
(``SRC_DIR`` default: the bundled tiny checkpoint, ``atom_core.paths``.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK = (128, 128)
FP8_MAX = 448.0
# Linear layers the published checkpoint quantises (suffixes of 2-D weights); everything else keeps its dtype.
QUANTISED = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "linear_attn.in_proj_qkvz.weight",
    "linear_attn.out_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def modules_to_not_convert(config: dict) -> list[str]:
    """The published list for this config's layers, in the published order."""
    out = ["lm_head"]
    for i, kind in enumerate(config["layer_types"]):
        if kind == "linear_attention":
            out.append(f"model.layers.{i}.linear_attn.in_proj_ba")
        out += [f"model.layers.{i}.mlp.gate", f"model.layers.{i}.mlp.shared_expert_gate"]
    out.append("mtp.fc")
    for j in range(int(config.get("mtp_num_hidden_layers", 0))):
        out += [f"mtp.layers.{j}.mlp.gate", f"mtp.layers.{j}.mlp.shared_expert_gate"]
    return out


def block_quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (float8_e4m3fn ``[N, K]``, float32 ``[ceil(N/bn), ceil(K/bk)]``) with per-block scale
    ``absmax / 448`` (an all-zero block gets scale 1) and ``q = round(w / scale)``."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * bn, cols * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def quantised(name: str, t: torch.Tensor, skip: list[str]) -> bool:
    module = name.rsplit(".", 1)[0]
    return t.dim() == 2 and name.endswith(QUANTISED) and module not in skip


def make_fp8_checkpoint(src: Path, dst: Path) -> dict:
    """Write the FP8 copy of ``src`` into ``dst`` (created; must not exist). Returns a summary."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src}/config.json already has a quantization_config")
    skip = modules_to_not_convert(config)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    dst.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total, n_fp8 = 0, 0
    for fname in sorted(set(index["weight_map"].values())):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(src / fname), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                t = f.get_tensor(name)
                if quantised(name, t, skip):
                    out[name], out[name + "_scale_inv"] = block_quantize(t)
                    n_fp8 += 1
                else:
                    out[name] = t
        save_file(out, str(dst / fname), metadata={"format": "pt"})
        for name, t in out.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": skip,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    return {"fp8_weights": n_fp8, "tensors": len(weight_map), "total_bytes": total}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", nargs="?", default=None, help="bf16 checkpoint (default: the bundled tiny model)")
    ap.add_argument("dst")
    args = ap.parse_args(argv)
    if args.src is None:
        from atom_core.paths import default_model_dir

        args.src = default_model_dir()
    summary = make_fp8_checkpoint(Path(args.src), Path(args.dst))
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
