"""Builders shared by this folder's tests: the state of one Gated DeltaNet layer and the fixture's float32
engine (the tiny config and random-weight layers, which the plugin's tests use too, are in
``atom_models.testing``). ``conftest.py`` puts this folder on ``sys.path`` (pytest runs with
--import-mode=importlib, which does not), so tests import it as ``_helpers``."""

from __future__ import annotations

import torch
from atom_models.engine import EngineConfig, LLMEngine
from atom_models.gdn_state import GDNGeometry, GDNLayerState

K_SPEC = 2  # speculative tokens the GDN layer tests size the verify and pending state for


def gdn_state(
    geo: GDNGeometry, num_slots: int = 4, *, conv_dtype: torch.dtype = torch.float32, device="cpu"
) -> GDNLayerState:
    """Zeroed state of one GDN layer for ``num_slots`` sequences: conv state in ``conv_dtype``, recurrent
    state (and the pending pool, with speculative tokens) in float32."""
    return GDNLayerState.allocate(
        geo, num_slots, conv_dtype=conv_dtype, ssm_dtype=torch.float32, device=device
    )


def float32_engine(
    model_dir, k: int, graphs: bool | None = True, *, device: torch.device | str = "cpu", **kw
) -> LLMEngine:
    """The checkpoint in ``model_dir`` as a float32 engine on ``device`` with ``k`` speculative tokens and
    ``cuda_graphs=graphs`` (bucketed steps, run eagerly on a CPU); ``max_model_len`` 256 and
    ``max_num_seqs`` 8 unless ``kw`` sets them (or other ``EngineConfig`` fields)."""
    cfg = EngineConfig(
        num_speculative_tokens=k, cuda_graphs=graphs, **{"max_model_len": 256, "max_num_seqs": 8, **kw}
    )
    return LLMEngine.from_pretrained(model_dir, cfg, dtype=torch.float32, device=device)


def greedy_mismatch(results, cases) -> str | None:
    """The first case whose output differs from ``greedy.json``'s, as ``"case i: first mismatch at token
    j (reference margin m)"``; None when every output equals its reference."""
    for i, (r, c) in enumerate(zip(results, cases)):
        if r.output_ids != c["greedy_ids"]:
            j = next(j for j, (a, b) in enumerate(zip(r.output_ids, c["greedy_ids"])) if a != b)
            return f"case {i}: first mismatch at token {j} (reference margin {c['top1_margin'][j]:.4f})"
    return None


# Lowest acceptance rate (accepted / drafted tokens) on greedy.json, float32: measured 219/289 = 0.758,
# 276/468 = 0.590, 310/627 = 0.494, 326/768 = 0.424 for k = 1..4 (equal to vLLM's with the plugin); the bar
# is 0.05 below. The float32 path is exact, so the figures are deterministic: a draft that drafts from a
# wrong position, state or KV slot falls far below them while the target's tokens stay exact.
MIN_ACCEPTANCE = {1: 0.70, 2: 0.54, 3: 0.44, 4: 0.37}
