"""Regenerate the float32 reference outputs of the bundled tiny model (the tests' oracles).

    uv run --no-sync python scripts/make_reference.py [--model DIR] [--out DIR] [--check DIR]

Reads ``<out>/inputs.json`` (the token ids, with the CPython 3.11 standard-library file each window
was cut from) and writes, in float32 on CPU with transformers' ``Qwen3NextForCausalLM``:

- ``golden.safetensors``: ``input_ids`` [3, 96] (inputs.json's ``golden_rows``); ``target_logits``
  [3, 96, V], teacher-forced; ``mtp_logits`` [3, 95, V], row i from the target's final post-norm hidden
  state h_i and the embedding of token i+1, at position i (it predicts token i+2).
- ``greedy.json``: the 64-token greedy continuation of each of inputs.json's 8 ``greedy_prompts``, and
  per step the margin between the best and the second-best logit (rounded to 1e-5).

transformers has no MTP module, so :class:`MTPHead` builds it from transformers' own blocks: the
``Qwen3NextRMSNorm`` (zero-centred, ``x * (1 + w)``) of ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden`` and ``mtp.norm``, a bias-free ``Linear`` for ``mtp.fc`` fed
``cat([norm(embedding), norm(hidden)])``, and one full-attention ``Qwen3NextDecoderLayer`` (with MoE)
loaded with ``mtp.layers.0.*``, under the target's rotary embedding and causal mask; embedding and lm_head
are the target's. Greedy steps recompute the whole sequence (no cache), so every logit comes from the
same teacher-forced forward as the golden rows.

``--check DIR`` compares the files written with another reference directory: identical input ids and
greedy tokens, logits within ``--atol`` (default 1e-4); prints the max abs errors, exits 1 otherwise.
Measured against the reference files this model was first shipped with (float32, CPU; transformers for
the target, the MTP head's training code for the draft): input ids and greedy tokens identical (8 x 64),
target logits max abs error 4.5e-05, MTP logits 3.6e-05, margins 3.0e-05 (transformers 5.19, torch 2.13).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3NextForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

DATA = Path(__file__).resolve().parents[1] / "data"


class MTPHead(nn.Module):
    """The checkpoint's ``mtp.*`` module from transformers' blocks; shares the target's embedding, rotary
    embedding and lm_head."""

    def __init__(self, target: Qwen3NextForCausalLM) -> None:
        super().__init__()
        cfg = copy.deepcopy(target.config)
        cfg.layer_types = ["full_attention"]  # the MTP layer is layer 0 of its own stack
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg, self.target = cfg, [target]  # a list: not a submodule, its weights are not ours
        self.pre_fc_norm_embedding = Qwen3NextRMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3NextRMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(cfg, 0)])
        self.norm = Qwen3NextRMSNorm(h, eps)

    def load(self, model_dir: Path) -> MTPHead:
        """Load the ``mtp.*`` tensors; per-expert ``gate_proj``/``up_proj``/``down_proj`` are stacked into
        transformers' fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
        weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
        raw: dict[str, torch.Tensor] = {}
        for file in sorted({f for k, f in weight_map.items() if k.startswith("mtp.")}):
            with safe_open(str(model_dir / file), "pt") as f:
                raw.update(
                    {k[4:]: f.get_tensor(k) for k, g in weight_map.items() if g == file and k[:4] == "mtp."}
                )
        prefix, n = "layers.0.mlp.experts.", self.cfg.num_experts
        gate, up, down = (
            [raw.pop(f"{prefix}{e}.{p}.weight") for e in range(n)]
            for p in ("gate_proj", "up_proj", "down_proj")
        )
        raw[prefix + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        raw[prefix + "down_proj"] = torch.stack(down)
        self.load_state_dict(raw, strict=True)
        return self.float().eval()

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, T-1, V] of draft rows 0..T-2 from ``input_ids`` [B, T] and the target's final
        post-norm hidden states ``hidden`` [B, T, H]."""
        target = self.target[0]
        emb = target.model.embed_tokens(input_ids[:, 1:])
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden[:, :-1])], -1))
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        mask = create_causal_mask(self.cfg, x, None, None, position_ids=pos)
        x = self.layers[0](x, target.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
        return target.lm_head(self.norm(x))


@torch.no_grad()
def golden(target: Qwen3NextForCausalLM, mtp: MTPHead, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    hidden = target.model(input_ids).last_hidden_state
    return {
        "input_ids": input_ids,
        "target_logits": target.lm_head(hidden),
        "mtp_logits": mtp(input_ids, hidden),
    }


@torch.no_grad()
def greedy(target: Qwen3NextForCausalLM, prompts: list[list[int]], steps: int) -> list[dict]:
    """Greedy continuations of equal-length ``prompts``, the whole sequence recomputed at every step."""
    ids, margins = torch.tensor(prompts), []
    for _ in range(steps):
        top = target(ids).logits[:, -1].topk(2, dim=-1)
        margins.append((top.values[:, 0] - top.values[:, 1]).tolist())
        ids = torch.cat([ids, top.indices[:, :1]], dim=1)
    n = ids.shape[1] - steps
    return [
        {"prompt_ids": p, "greedy_ids": ids[i, n:].tolist(), "top1_margin": [round(m[i], 5) for m in margins]}
        for i, p in enumerate(prompts)
    ]


def check(out: Path, ref: Path, atol: float) -> bool:
    """Compare ``out``'s golden.safetensors and greedy.json with ``ref``'s; print the errors."""
    a, b = load_file(str(out / "golden.safetensors")), load_file(str(ref / "golden.safetensors"))
    ok = torch.equal(a["input_ids"], b["input_ids"])
    print(f"input_ids identical: {ok}")
    for key in ("target_logits", "mtp_logits"):
        err = (a[key] - b[key]).abs().max().item() if a[key].shape == b[key].shape else float("inf")
        print(f"{key}: max abs error {err:.2e} (atol {atol:.0e})")
        ok &= err <= atol
    ga = json.loads((out / "greedy.json").read_text())["cases"]
    gb = json.loads((ref / "greedy.json").read_text())["cases"]
    same = [x["prompt_ids"] == y["prompt_ids"] and x["greedy_ids"] == y["greedy_ids"] for x, y in zip(ga, gb)]
    same_tokens = len(ga) == len(gb) and all(same)
    margin = max(abs(u - v) for x, y in zip(ga, gb) for u, v in zip(x["top1_margin"], y["top1_margin"]))
    print(
        f"greedy tokens identical: {same_tokens} ({sum(same)} of {len(gb)} cases); margins max abs diff {margin:.2e}"
    )
    return ok and same_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DATA / "tiny-qwen3-next-mtp", help="checkpoint directory")
    ap.add_argument(
        "--out", type=Path, default=DATA / "tiny-qwen3-next-mtp-reference", help="holds inputs.json"
    )
    ap.add_argument("--check", type=Path, default=None, help="reference directory to compare with")
    ap.add_argument("--atol", type=float, default=1e-4, help="logit tolerance of --check")
    args = ap.parse_args()
    inputs = json.loads((args.out / "inputs.json").read_text())
    target = Qwen3NextForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    mtp = MTPHead(target).load(args.model)
    rows = torch.tensor([r["input_ids"] for r in inputs["golden_rows"]])
    save_file(golden(target, mtp, rows), str(args.out / "golden.safetensors"))
    prompts = [p["prompt_ids"] for p in inputs["greedy_prompts"]]
    steps = inputs["greedy_max_new_tokens"]
    cases = greedy(target, prompts, steps)
    payload = {"dtype": "float32", "max_new_tokens": steps, "cases": cases}
    (args.out / "greedy.json").write_text(json.dumps(payload) + "\n")
    smallest = min(min(c["top1_margin"]) for c in cases)
    print(f"wrote {args.out}/golden.safetensors and greedy.json (smallest top-1 margin {smallest})")
    return 0 if args.check is None or check(args.out, args.check, args.atol) else 1


if __name__ == "__main__":
    sys.exit(main())
