"""atom-models' ``ParallelContext`` over vLLM's tensor-parallel group.

The collectives are vLLM's own (``vllm.distributed``), the ones its ``RowParallelLinear`` /
``VocabParallelEmbedding`` / ``LogitsProcessor`` call: ``tensor_model_parallel_all_reduce`` and
``tensor_model_parallel_all_gather`` go through the group coordinator, which on platforms that opt in
(CUDA, ROCm, XPU) dispatches to the ``torch.ops.vllm.all_reduce`` / ``all_gather`` custom ops that vLLM's
torch.compile keeps as graph nodes, and on CPU to the group's communicator (shared-memory or gloo), which
vLLM's compiled CPU models trace the same way. With a world size of 1 both return their input.
"""

from __future__ import annotations

import torch


class VllmTensorParallel:
    """vLLM's TP group as an ``atom_models.parallel.ParallelContext`` (rank and size read at construction,
    when vLLM has initialised its model-parallel groups: inside the model constructor)."""

    def __init__(self) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self._rank = get_tensor_model_parallel_rank()
        self._world_size = get_tensor_model_parallel_world_size()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def capturable(self) -> bool:
        """True: vLLM captures its CUDA graphs with its own communicators (custom all-reduce, NCCL)."""
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        from vllm.distributed import tensor_model_parallel_all_gather

        return tensor_model_parallel_all_gather(x, dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        from vllm.distributed import get_tp_group

        return get_tp_group().broadcast(x, src)

    def __repr__(self) -> str:
        return f"VllmTensorParallel(rank={self._rank}, world_size={self._world_size})"
