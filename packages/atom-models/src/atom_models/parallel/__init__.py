"""Tensor parallelism for atom-models: an injected communicator and the per-rank layout of the model."""

from atom_models.parallel.context import ParallelContext, SingleProcess, TorchDistributed
from atom_models.parallel.layout import TPLayout

__all__ = ["ParallelContext", "SingleProcess", "TPLayout", "TorchDistributed"]
