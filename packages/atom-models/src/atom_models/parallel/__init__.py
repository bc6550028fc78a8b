"""Tensor parallelism for atom-models: an injected communicator, the per-rank layout of the model, and the
sharded layers (column/row-parallel linears, vocabulary-parallel embedding and LM head)."""

from atom_models.parallel.context import (
    SINGLE_PROCESS,
    ParallelContext,
    RankWithoutGroup,
    SingleProcess,
    TorchDistributed,
)
from atom_models.parallel.layout import TPLayout
from atom_models.parallel.linear import Linear, column_parallel_linear, row_parallel_linear
from atom_models.parallel.shard import LinearShard
from atom_models.parallel.vocab import VocabParallelEmbedding, parallel_lm_head

__all__ = [
    "SINGLE_PROCESS",
    "column_parallel_linear",
    "Linear",
    "LinearShard",
    "ParallelContext",
    "RankWithoutGroup",
    "parallel_lm_head",
    "row_parallel_linear",
    "SingleProcess",
    "TPLayout",
    "TorchDistributed",
    "VocabParallelEmbedding",
]
