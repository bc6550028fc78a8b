"""Greedy consistency (docs/design.md, "Oracles"): teacher-force emitted tokens through transformers in float32.

For each emitted token, ``gap = max_logit - logit[emitted]`` under the float32 reference given the
prompt and the tokens emitted before it. A gap of 0 means the token is the float32 argmax; bf16 runs may
pick near-ties (small gaps); a wrong path emits tokens with large gaps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from atom_core import testing

OFF_ARGMAX = 1e-3
"""A token counts as "not the float32 argmax" when its gap exceeds this (float32 rounding noise)."""


@dataclass(frozen=True)
class Consistency:
    tokens: int
    off_argmax: int
    max_gap: float


@cache
def _hf_model(model_dir: str):
    transformers = testing.import_oracle("transformers", "transformers (the float32 reference)")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def consistency(model_dir: str, prompts: list[list[int]], outputs: list[list[int]]) -> Consistency:
    model = _hf_model(model_dir)
    off, max_gap, n = 0, 0.0, 0
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt + out])
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(out)].float()
        emitted = torch.tensor(out)
        gaps = logits.max(dim=-1).values - logits.gather(1, emitted[:, None])[:, 0]
        off += int((gaps > OFF_ARGMAX).sum())
        max_gap = max(max_gap, float(gaps.max()))
        n += len(out)
    return Consistency(tokens=n, off_argmax=off, max_gap=max_gap)
