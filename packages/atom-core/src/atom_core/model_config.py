"""Typed Qwen3-Next configuration parsed from a Hugging Face ``config.json``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from atom_core._reader import FieldReader
from atom_core._source import load_raw
from atom_core.errors import ConfigError
from atom_core.quant_config import Fp8QuantConfig

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)


@dataclass(frozen=True)
class Qwen3NextConfig:
    """Everything the Qwen3-Next target and its MTP draft need, validated.

    Built with :meth:`from_hf`; vary it with ``dataclasses.replace``.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    # misc
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_mtp_layers: int
    eos_token_id: tuple[int, ...] = ()
    quantization: Fp8QuantConfig | None = None
    source: str = field(default="<dict>", compare=False)

    def __post_init__(self) -> None:
        """Invariants that must also hold for configs varied with ``dataclasses.replace``."""

        def fail(name: str, problem: str) -> ConfigError:
            return ConfigError(name, getattr(self, name), self.source, problem)

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size", "decoder_sparse_step",
            "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(name, "expected a positive integer")
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "num_mtp_layers"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise fail(name, "expected a non-negative integer")
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_hidden_layers:
            raise fail(
                "layer_types", f"expected a tuple of {self.num_hidden_layers} entries (num_hidden_layers)"
            )
        if any(t not in LAYER_TYPES for t in self.layer_types):
            raise fail("layer_types", f"known layer types: {list(LAYER_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise fail("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise fail(
                "linear_num_value_heads",
                f"must be a multiple of linear_num_key_heads={self.linear_num_key_heads}",
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise fail("num_experts_per_tok", f"must be in [1, num_experts={self.num_experts}]")
        if self.num_experts and self.moe_intermediate_size < 1:
            raise fail("moe_intermediate_size", "must be >= 1 when num_experts > 0")
        if not 0 < self.partial_rotary_factor <= 1:
            raise fail("partial_rotary_factor", "must be in (0, 1]")
        if int(self.head_dim * self.partial_rotary_factor) % 2:
            raise fail("partial_rotary_factor", f"rotary dim head_dim*factor must be even ({self.head_dim})")
        if not self.rope_theta > 0:
            raise fail("rope_theta", "must be > 0")
        if not self.rms_norm_eps > 0:
            raise fail("rms_norm_eps", "must be > 0")
        for name in ("mlp_only_layers", "eos_token_id"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or any(
                isinstance(v, bool) or not isinstance(v, int) for v in value
            ):
                raise fail(name, "expected a tuple of integers")

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        """Number of leading channels of each attention head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN depthwise conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` (absolute; MTP layers included) uses the sparse MoE block."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def mtp_layer_index(self, i: int) -> int:
        """Absolute layer index of MTP layer ``i``: ``num_hidden_layers + i`` (never a target index)."""
        if not 0 <= i < self.num_mtp_layers:
            raise IndexError(f"MTP layer {i} out of range: the model has {self.num_mtp_layers} MTP layers")
        return self.num_hidden_layers + i

    # ---- parsing ------------------------------------------------------------------------------
    @classmethod
    def from_hf(
        cls, path_or_dict: str | os.PathLike[str] | Mapping[str, Any], *, source: str | None = None
    ) -> Qwen3NextConfig:
        """Parse a HF Qwen3-Next ``config.json`` (a path, its directory, or the loaded dict; ``source``
        names where a dict came from in error messages)."""
        raw, source = load_raw(path_or_dict, source)
        r = FieldReader(raw, source)
        model_type = r.str("model_type")
        if model_type not in ("qwen3_next", "qwen3_next_mtp"):
            raise r.fail("model_type", model_type, "expected 'qwen3_next' (or vLLM's 'qwen3_next_mtp')")
        if r.str("hidden_act", "silu") != "silu":
            raise r.fail("hidden_act", r.get("hidden_act"), "only 'silu' is supported")

        n_layers = r.int("num_hidden_layers", minimum=1)
        layer_types = _layer_types(r, n_layers)
        rope_theta, partial = _rope(r)

        heads = r.int("num_attention_heads", minimum=1)
        kv_heads = r.int("num_key_value_heads", minimum=1)
        if heads % kv_heads:
            raise r.fail("num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
        hidden = r.int("hidden_size", minimum=1)
        head_dim = r.int("head_dim", hidden // heads, minimum=1)
        if int(head_dim * partial) % 2:
            raise r.fail(
                "partial_rotary_factor", partial, f"rotary dim head_dim*factor must be even ({head_dim})"
            )

        lk_heads = r.int("linear_num_key_heads", minimum=1)
        lv_heads = r.int("linear_num_value_heads", minimum=1)
        if lv_heads % lk_heads:
            raise r.fail(
                "linear_num_value_heads", lv_heads, f"must be a multiple of linear_num_key_heads={lk_heads}"
            )

        num_experts = r.int("num_experts", 0, minimum=0)
        top_k = r.int("num_experts_per_tok", 0, minimum=0)
        if num_experts and not 1 <= top_k <= num_experts:
            raise r.fail("num_experts_per_tok", top_k, f"must be in [1, num_experts={num_experts}]")

        n_mtp = _num_mtp_layers(r)
        eos = r.get("eos_token_id", None)
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, list):
            eos_ids = r.int_list("eos_token_id")
        else:
            eos_ids = (r.int("eos_token_id", minimum=0),)

        quant_reader = r.sub("quantization_config")
        quant = Fp8QuantConfig.from_reader(quant_reader) if quant_reader is not None else None

        return cls(
            vocab_size=r.int("vocab_size", minimum=1),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            partial_rotary_factor=partial,
            rope_theta=rope_theta,
            attention_bias=r.bool("attention_bias", False),
            linear_num_key_heads=lk_heads,
            linear_num_value_heads=lv_heads,
            linear_key_head_dim=r.int("linear_key_head_dim", minimum=1),
            linear_value_head_dim=r.int("linear_value_head_dim", minimum=1),
            linear_conv_kernel_dim=r.int("linear_conv_kernel_dim", minimum=1),
            intermediate_size=r.int("intermediate_size", minimum=1),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=r.int("moe_intermediate_size", 0, minimum=0 if not num_experts else 1),
            shared_expert_intermediate_size=r.int("shared_expert_intermediate_size", 0, minimum=0),
            norm_topk_prob=r.bool("norm_topk_prob", True),
            decoder_sparse_step=r.int("decoder_sparse_step", 1, minimum=1),
            mlp_only_layers=r.int_list("mlp_only_layers", []),
            rms_norm_eps=r.float("rms_norm_eps", 1e-6, positive=True),
            tie_word_embeddings=r.bool("tie_word_embeddings", False),
            max_position_embeddings=r.int("max_position_embeddings", minimum=1),
            num_mtp_layers=n_mtp,
            eos_token_id=tuple(eos_ids),
            quantization=quant,
            source=source,
        )


def _layer_types(r: FieldReader, n_layers: int) -> tuple[str, ...]:
    """``layer_types`` if given, else the published rule: every ``full_attention_interval``-th layer is full."""
    if r.get("layer_types", None) is not None:
        types = r.str_list("layer_types")
        if len(types) != n_layers:
            raise r.fail("layer_types", list(types), f"expected {n_layers} entries (num_hidden_layers)")
        for t in types:
            if t not in LAYER_TYPES:
                raise r.fail(
                    "layer_types", list(types), f"unknown layer type {t!r}; known: {list(LAYER_TYPES)}"
                )
        return types
    interval = r.int("full_attention_interval", minimum=1)
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers))


def _rope(r: FieldReader) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` from ``rope_parameters`` or the top-level fields."""
    params = r.sub("rope_parameters")
    if params is not None:
        rope_type = params.str("rope_type", "default")
        if rope_type != "default":
            raise params.fail("rope_type", rope_type, "only the default RoPE is supported")
        theta = params.float("rope_theta", positive=True)
        partial = params.float("partial_rotary_factor", r.get("partial_rotary_factor", 1.0))
    else:
        scaling = r.get("rope_scaling", None)
        if scaling not in (None, {}):
            raise r.fail("rope_scaling", scaling, "RoPE scaling is not supported")
        theta = r.float("rope_theta", positive=True)
        partial = r.float("partial_rotary_factor", 1.0)
    if not 0 < partial <= 1:
        raise r.fail("partial_rotary_factor", partial, "must be in (0, 1]")
    return theta, partial


def _num_mtp_layers(r: FieldReader) -> int:
    a = r.get("mtp_num_hidden_layers", None)
    b = r.get("num_nextn_predict_layers", None)
    if a is not None and b is not None and a != b:
        raise r.fail("num_nextn_predict_layers", b, f"disagrees with mtp_num_hidden_layers={a}")
    if a is not None:
        return r.int("mtp_num_hidden_layers", minimum=0)
    if b is not None:
        return r.int("num_nextn_predict_layers", minimum=0)
    return 0
