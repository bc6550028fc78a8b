"""vLLM's speculative-decoding counters of an offline ``vllm.LLM`` (a helper of ``scripts/gpu_vllm_run.py`` and
``benchmarks/gpu/bench_vllm_80b.py``; the benchmark puts ``scripts/`` on ``sys.path`` first).

The ``LLM`` must be built with ``disable_log_stats=False``; ``LLM.get_metrics()`` then carries
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens`` and ``..._num_accepted_tokens`` (one sample per
engine). The server's ``/metrics`` carries the same counters (``tests/_server.py`` reads those).
"""

from __future__ import annotations

from typing import Any

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(llm: Any) -> dict[str, int]:
    """``{"num_drafts", "num_draft_tokens", "num_accepted_tokens"}`` of ``llm`` now, summed over engines."""
    out = dict.fromkeys(SPEC_COUNTERS, 0)
    for metric in llm.get_metrics():
        key = metric.name.removeprefix("vllm:spec_decode_")
        if key != metric.name and key in out:
            out[key] += int(metric.value)
    return out
