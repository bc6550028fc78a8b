"""atom-models: Qwen3-Next target + MTP draft built on atom_kernels, HF checkpoint loading, a standalone engine."""

from atom_models.dense_cores import DenseContext, DenseCoreFactory
from atom_models.loader import CheckpointError, checkpoint_files, load_mtp, load_target
from atom_models.moe import hold_float32_experts
from atom_models.parallel.linear import hold_packed_linears
from atom_models.qwen3_next import CoreFactory, Qwen3NextForCausalLM
from atom_models.qwen3_next_mtp import Qwen3NextMTP

__all__ = [
    "CheckpointError",
    "CoreFactory",
    "DenseContext",
    "DenseCoreFactory",
    "Qwen3NextForCausalLM",
    "Qwen3NextMTP",
    "checkpoint_files",
    "hold_float32_experts",
    "hold_packed_linears",
    "load_mtp",
    "load_target",
]
