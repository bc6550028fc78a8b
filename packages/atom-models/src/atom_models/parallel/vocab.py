"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous range of vocabulary rows.

- :class:`VocabParallelEmbedding`: a rank looks up the ids in its range, writes zeros for the others, and
  the all-reduce assembles every token's row (exactly one rank contributes a non-zero row per token).
- :func:`parallel_lm_head`: a column-parallel linear over the vocabulary; ``forward`` returns this rank's
  logits ``[T, V / tp]``; the model's ``compute_logits`` all-gathers them into ``[T, V]`` on every rank.

Both split ``num_embeddings`` the same way, so a tied head can share the embedding's weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_models.parallel.context import SINGLE_PROCESS, ParallelContext
from atom_models.parallel.linear import Linear, column_parallel_linear


def vocab_range(num_embeddings: int, parallel: ParallelContext) -> tuple[int, int]:
    """This rank's ``[start, end)`` of the vocabulary (``num_embeddings`` divisible by the world size)."""
    tp = parallel.world_size
    if num_embeddings % tp:
        raise ValueError(
            f"vocabulary of {num_embeddings} rows is not divisible by the tensor parallel size {tp}"
        )
    n = num_embeddings // tp
    return parallel.rank * n, (parallel.rank + 1) * n


class VocabParallelEmbedding(nn.Module):
    """Token embedding ``weight[V / tp, H]``: rows ``[vocab_start, vocab_end)`` of the full table."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        parallel: ParallelContext = SINGLE_PROCESS,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings  # the full vocabulary
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, parallel)
        self.weight = nn.Parameter(
            torch.empty(self.vocab_end - self.vocab_start, embedding_dim, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = torch.where(outside, 0, input_ids - self.vocab_start)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) "
            f"on rank {self.parallel.rank} of {self.parallel.world_size}"
        )


def parallel_lm_head(
    hidden_size: int,
    num_embeddings: int,
    parallel: ParallelContext = SINGLE_PROCESS,
    dtype: torch.dtype | None = None,
) -> Linear:
    """A column-parallel :class:`Linear` ``weight[V / tp, H]`` (the same rows as
    :class:`VocabParallelEmbedding`); ``forward`` -> this rank's logits."""
    vocab_range(num_embeddings, parallel)
    return column_parallel_linear(hidden_size, num_embeddings, parallel, dtype=dtype)
