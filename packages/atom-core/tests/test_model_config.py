from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from atom_core import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, Qwen3NextConfig

DATA = Path(__file__).parent / "data"


def test_published_80b_instruct(instruct_raw):
    c = Qwen3NextConfig.from_hf(instruct_raw)
    assert c.num_hidden_layers == 48 and c.hidden_size == 2048 and c.vocab_size == 151936
    assert c.full_attention_layers == tuple(range(3, 48, 4))
    assert len(c.linear_attention_layers) == 36
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 2, 256)
    assert c.rotary_dim == 64 and c.rope_theta == 1e7
    assert (c.linear_key_dim, c.linear_value_dim, c.linear_conv_dim) == (2048, 4096, 8192)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (512, 10, 512)
    assert c.shared_expert_intermediate_size == 512 and c.norm_topk_prob
    assert c.num_mtp_layers == 1 and c.mtp_layer_index(0) == 48
    assert all(c.is_moe_layer(i) for i in range(49))
    assert c.quantization is None and c.eos_token_id == (151645,)


def test_published_80b_fp8(fp8_raw):
    c = Qwen3NextConfig.from_hf(fp8_raw)
    q = c.quantization
    assert q is not None and q.fmt == "e4m3" and q.activation_scheme == "dynamic"
    assert q.weight_block_size == (128, 128)
    skip = set(q.modules_to_not_convert)
    assert {"mtp.fc", "model.layers.0.linear_attn.in_proj_ba", "lm_head"} <= skip
    assert "model.layers.0.linear_attn.in_proj_qkvz" not in skip


def test_fixture_config_file(tiny_dir):
    c = Qwen3NextConfig.from_hf(tiny_dir)  # a directory means its config.json
    assert c.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert c.rotary_dim == 32 and c.rope_theta == 1e7  # from rope_parameters
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (2, 4)
    assert c.linear_conv_dim == 2 * 256 + 512
    assert c.num_mtp_layers == 1 and c.mtp_layer_index(0) == 4
    assert c.source.endswith("config.json")
    assert Qwen3NextConfig.from_hf(tiny_dir / "config.json") == c


def test_num_nextn_predict_layers_alias(instruct_raw):
    raw = dict(instruct_raw)
    del raw["mtp_num_hidden_layers"]
    raw["num_nextn_predict_layers"] = 2
    c = Qwen3NextConfig.from_hf(raw)
    assert c.num_mtp_layers == 2 and c.mtp_layer_index(1) == 49
    with pytest.raises(IndexError, match="MTP layer 2"):
        c.mtp_layer_index(2)


def test_vllm_draft_model_type_accepted(instruct_raw):
    raw = dict(instruct_raw, model_type="qwen3_next_mtp", architectures=["Qwen3NextMTP"])
    assert Qwen3NextConfig.from_hf(raw).num_mtp_layers == 1


def test_frozen_and_replace(instruct_raw):
    c = Qwen3NextConfig.from_hf(instruct_raw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1  # type: ignore[misc]
    d = dataclasses.replace(c, num_mtp_layers=0)
    assert d.num_mtp_layers == 0 and c.num_mtp_layers == 1


def _without(raw: dict, key: str) -> dict:
    out = dict(raw)
    del out[key]
    return out


# (description, mutation, field named in the error, fragment of the problem)
MALFORMED = [
    ("missing hidden_size", lambda r: _without(r, "hidden_size"), "hidden_size", "missing"),
    ("hidden_size as string", lambda r: dict(r, hidden_size="2048"), "hidden_size", "integer"),
    ("bool is not an int", lambda r: dict(r, num_hidden_layers=True), "num_hidden_layers", "integer"),
    ("zero layers", lambda r: dict(r, num_hidden_layers=0), "num_hidden_layers", ">= 1"),
    ("kv heads do not divide", lambda r: dict(r, num_key_value_heads=3), "num_key_value_heads", "divide"),
    (
        "unknown layer type",
        lambda r: dict(r, layer_types=["linear_attention"] * 47 + ["sliding"]),
        "layer_types",
        "unknown layer type",
    ),
    ("layer_types wrong length", lambda r: dict(r, layer_types=["full_attention"] * 3), "layer_types", "48"),
    (
        "no layer_types and no interval",
        lambda r: _without(r, "full_attention_interval"),
        "full_attention_interval",
        "missing",
    ),
    ("negative rope theta", lambda r: dict(r, rope_theta=-1), "rope_theta", "> 0"),
    (
        "rope scaling",
        lambda r: dict(r, rope_scaling={"type": "yarn", "factor": 4}),
        "rope_scaling",
        "not supported",
    ),
    ("rotary factor > 1", lambda r: dict(r, partial_rotary_factor=1.5), "partial_rotary_factor", "(0, 1]"),
    ("top-k > experts", lambda r: dict(r, num_experts_per_tok=600), "num_experts_per_tok", "num_experts=512"),
    (
        "GDN value heads not a multiple",
        lambda r: dict(r, linear_num_value_heads=24),
        "linear_num_value_heads",
        "multiple",
    ),
    ("wrong model type", lambda r: dict(r, model_type="llama"), "model_type", "qwen3_next"),
    ("gelu activation", lambda r: dict(r, hidden_act="gelu"), "hidden_act", "silu"),
    (
        "MTP alias disagrees",
        lambda r: dict(r, num_nextn_predict_layers=2),
        "num_nextn_predict_layers",
        "disagrees",
    ),
    (
        "rope_parameters of another type",
        lambda r: dict(r, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}),
        "rope_parameters.rope_type",
        "default",
    ),
    (
        "rope_parameters without theta",
        lambda r: dict(r, rope_parameters={"rope_type": "default"}),
        "rope_parameters.rope_theta",
        "missing",
    ),
    (
        "mlp_only_layers not ints",
        lambda r: dict(r, mlp_only_layers=["0"]),
        "mlp_only_layers",
        "list of integers",
    ),
    (
        "quant method awq",
        lambda r: dict(r, quantization_config={"quant_method": "awq"}),
        "quantization_config.quant_method",
        "fp8",
    ),
    (
        "fp8 without block size",
        lambda r: dict(r, quantization_config={"quant_method": "fp8"}),
        "quantization_config.weight_block_size",
        "missing",
    ),
    (
        "fp8 block of three",
        lambda r: dict(r, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128, 1]}),
        "quantization_config.weight_block_size",
        "two positive",
    ),
    (
        "fp8 static activations",
        lambda r: dict(
            r,
            quantization_config={
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "activation_scheme": "static",
            },
        ),
        "quantization_config.activation_scheme",
        "dynamic",
    ),
    (
        "fp8 e5m2",
        lambda r: dict(
            r, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}
        ),
        "quantization_config.fmt",
        "e4m3",
    ),
]


@pytest.mark.parametrize("desc,mutate,field,problem", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_dict_names_field_and_value(instruct_raw, desc, mutate, field, problem):
    raw = mutate(instruct_raw)
    with pytest.raises(ConfigError) as err:
        Qwen3NextConfig.from_hf(raw)
    e = err.value
    assert e.field == field, f"{desc}: error named {e.field!r}: {e}"
    assert problem in e.problem, f"{desc}: {e}"
    assert e.source == "<dict>"
    assert repr(e.value) in str(e) and field in str(e)


def test_malformed_file_names_the_file(tmp_path, instruct_raw):
    bad = dict(instruct_raw, num_attention_heads="sixteen")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError) as err:
        Qwen3NextConfig.from_hf(tmp_path)
    assert err.value.source == str(path) and "num_attention_heads" in str(err.value)
    assert "'sixteen'" in str(err.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        Qwen3NextConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Qwen3NextConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        Qwen3NextConfig.from_hf(tmp_path)


def test_test_data_files_are_the_published_shape():
    names = sorted(p.name for p in DATA.glob("*.json"))
    assert names == ["qwen3-next-80b-a3b-instruct-fp8.json", "qwen3-next-80b-a3b-instruct.json"]


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_hidden_layers": 47}, "layer_types"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
        ({"eos_token_id": [1]}, "eos_token_id"),
        ({"layer_types": ("linear_attention",) * 47 + ("mamba",)}, "layer_types"),
    ],
)
def test_replace_cannot_build_an_invalid_config(instruct_raw, change, field):
    c = Qwen3NextConfig.from_hf(instruct_raw)
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(c, **change)
    assert err.value.field == field


@pytest.mark.parametrize(
    "eos,problem", [(True, "integer"), ([1, "2"], "list of integers"), (-3, ">= 0"), ("0", "integer")]
)
def test_malformed_eos_token_id(instruct_raw, eos, problem):
    with pytest.raises(ConfigError) as err:
        Qwen3NextConfig.from_hf(dict(instruct_raw, eos_token_id=eos))
    assert err.value.field == "eos_token_id" and problem in err.value.problem


def test_eos_token_id_forms(instruct_raw):
    assert Qwen3NextConfig.from_hf(dict(instruct_raw, eos_token_id=[151645, 151643])).eos_token_id == (
        151645,
        151643,
    )
    assert Qwen3NextConfig.from_hf(_without(instruct_raw, "eos_token_id")).eos_token_id == ()
