"""The standalone engine: paged KV cache, GDN state slots, continuous batching, MTP speculative decoding."""

from atom_models.engine.engine import EngineConfig, GenerationResult, LLMEngine, StepInfo
from atom_models.engine.request import SpecStats
from atom_models.engine.sampling import SamplingParams

__all__ = ["EngineConfig", "GenerationResult", "LLMEngine", "SamplingParams", "SpecStats", "StepInfo"]
