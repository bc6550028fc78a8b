"""Plugin on/off, a checkpoint without its MTP head, an unsupported KV-cache dtype.

(Tensor parallel 2: tests/test_vllm_tp.py; vLLM's default compilation: test_vllm_float32_greedy.py and
test_vllm_bf16_acceptance.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _vllm import (
    WORKDIR,
    engine_result,
    engine_run,
    greedy_job,
    model_dir,
    plan,
    requires_vllm,
    spec,
    vllm_runs,
)

pytestmark = [requires_vllm, pytest.mark.slow]


def _log(result) -> str:
    return Path(result["log"]).read_text()


@vllm_runs("bf16_stock_k1_eager", "bf16_plugin_k1_eager")
def test_plugin_switch_selects_the_implementation() -> None:
    """ATOM_DISABLE_VLLM_PLUGIN=1 runs vLLM's own Qwen3-Next; unset, the log names ATOM's (the runs of
    test_vllm_bf16_acceptance.py)."""
    stock, atom = engine_run("bf16_stock_k1_eager"), engine_run("bf16_plugin_k1_eager")
    assert "ATOM vLLM plugin disabled" in _log(stock) and "ATOM vLLM plugin active" not in _log(stock)
    assert "ATOM vLLM plugin active" in _log(atom)
    assert "qwen_gdn_linear_attn" in _log(stock)  # vLLM's GDN layer logs its kernel choice; ours does not
    assert "qwen_gdn_linear_attn" not in _log(atom)


def _checkpoint_without_mtp() -> Path:
    """A copy of the bundled checkpoint whose index and files hold no mtp.* tensor."""
    src = model_dir()
    dst = WORKDIR / "no-mtp"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    kept = {n: f for n, f in index["weight_map"].items() if not n.startswith("mtp.")}
    assert len(kept) < len(index["weight_map"])
    for f in set(kept.values()):
        shutil.copy(src / f, dst / f)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    (dst / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": kept}))
    return dst


plan(
    "no_mtp",
    lambda: spec(
        plugin=True, dtype="float32", k=1, jobs=[greedy_job()], model=str(_checkpoint_without_mtp())
    ),
)
plan(
    "fp8_e5m2_kv",
    lambda: spec(
        plugin=True, dtype="bfloat16", k=1, jobs=[greedy_job()], llm_kwargs={"kv_cache_dtype": "fp8_e5m2"}
    ),
)


@vllm_runs("no_mtp")
def test_checkpoint_without_mtp_tensors_fails_naming_them() -> None:
    r = engine_result("no_mtp")
    index = json.loads((WORKDIR / "no-mtp" / "model.safetensors.index.json").read_text())
    assert not any(n.startswith("mtp.") for n in index["weight_map"])
    assert "error" in r, "vLLM started an MTP draft from a checkpoint without mtp.* tensors"
    log = Path(r["log"]).read_text()
    assert "CheckpointError" in log and "no mtp.* tensors" in log, log[-3000:]
    assert "mtp.fc.weight" in log and "mtp.layers.0.self_attn.q_proj.weight" in log, log[-3000:]


@vllm_runs("fp8_e5m2_kv")
def test_unsupported_kv_cache_dtype_fails_clearly() -> None:
    """An e5m2 KV cache is not supported by the plugin's attention (e4m3 is): the engine must refuse to
    start with an error naming the option, not run with a silently different cache."""
    r = engine_result("fp8_e5m2_kv")
    assert "error" in r, "the engine started with kv_cache_dtype=fp8_e5m2"
    log = Path(r["log"]).read_text()
    # the plugin's own ConfigError (not merely the echoed engine arguments) names the field and the value
    assert "field 'kv_cache_dtype' = 'fp8_e5m2'" in log, log[-3000:]
