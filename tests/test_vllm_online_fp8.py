"""vLLM's online FP8 (``quantization="fp8"`` on the bundled bf16 checkpoint, which has no ``quantization_config``)
with the ATOM plugin: refused at engine start with an error naming the flag, before any weight is read.

The plugin's models are atom-models' modules, not vLLM's quantisable layers, so vLLM's online quantisation
would not reach them: served, the flag would be silently ignored. FP8 through the plugin comes from FP8
checkpoints (``tests/test_vllm_fp8.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _vllm import engine_result, greedy_job, plan, requires_vllm, spec, vllm_runs

pytestmark = [requires_vllm, pytest.mark.slow]

plan(
    "bf16_plugin_k1_online_fp8",
    lambda: spec(plugin=True, dtype="bfloat16", k=1, jobs=[greedy_job()], llm_kwargs={"quantization": "fp8"}),
)


@vllm_runs("bf16_plugin_k1_online_fp8")
def test_online_fp8_on_a_bf16_checkpoint_is_refused_by_name() -> None:
    r = engine_result("bf16_plugin_k1_online_fp8")
    assert "error" in r, "vLLM served quantization='fp8' on a checkpoint without quantization_config"
    log = Path(r["log"]).read_text() if "log" in r else r.get("log_tail", "")
    assert "field 'quantization' = 'fp8'" in log and "does not quantise weights online" in log, (
        r["error"] + "\n" + log[-3000:]
    )
    assert "Loading weights took" not in log, "the refusal came after weights were loaded"
