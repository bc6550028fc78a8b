"""atom-core: typed, validated configuration for Qwen3-Next + MTP. Standard library only."""

from atom_core.errors import ConfigError
from atom_core.model_config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3NextConfig
from atom_core.quant_config import Fp8QuantConfig
from atom_core.runtime_config import MAX_SPECULATIVE_TOKENS, CacheConfig, SpeculativeConfig

__all__ = [
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "MAX_SPECULATIVE_TOKENS",
    "CacheConfig",
    "ConfigError",
    "Fp8QuantConfig",
    "Qwen3NextConfig",
    "SpeculativeConfig",
]
