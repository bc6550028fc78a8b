"""Speculative-decoding and cache configs (what vLLM or our own engine passes down)."""

from __future__ import annotations

from dataclasses import dataclass

from atom_core.errors import ConfigError

SPEC_METHODS = ("mtp",)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3")
MAX_SPECULATIVE_TOKENS = 8
"""Cap on ``num_speculative_tokens`` for Qwen3-Next MTP: the largest k tested exact (float32 greedy through
vLLM with the ATOM plugin, ``tests/test_vllm_long_k.py``). The deferred-commit verify keeps one committed
GDN state plus 1 + k pending tokens per sequence (``gdn_state_memory.py`` reports the bytes per k)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """MTP speculative decoding: the draft proposes ``num_speculative_tokens`` tokens per step
    (``1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS``)."""

    method: str = "mtp"
    num_speculative_tokens: int = 1

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                "method", self.method, "speculative_config", f"supported methods: {list(SPEC_METHODS)}"
            )
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int):
            raise ConfigError(
                "num_speculative_tokens",
                self.num_speculative_tokens,
                "speculative_config",
                "expected an integer",
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                "num_speculative_tokens",
                self.num_speculative_tokens,
                "speculative_config",
                f"must be in [1, {MAX_SPECULATIVE_TOKENS}] for Qwen3-Next MTP",
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache layout: ``block_size`` tokens per block, ``kv_cache_dtype`` storage."""

    block_size: int = 16
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError("block_size", self.block_size, "cache_config", "expected a positive integer")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                "kv_cache_dtype", self.kv_cache_dtype, "cache_config", f"one of {list(KV_CACHE_DTYPES)}"
            )
