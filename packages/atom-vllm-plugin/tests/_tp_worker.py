"""One rank of test_parallel.py: vLLM's distributed environment on CPU (gloo + vLLM's CPU communicator), the
plugin's VllmTensorParallel checked eagerly and inside torch.compile(fullgraph). Run as
``python _tp_worker.py RANK WORLD_SIZE PORT OUT_JSON``; writes what it measured."""

from __future__ import annotations

import json
import sys


def main(rank: int, world: int, port: int, out: str) -> None:
    import torch
    from atom_models.parallel import ParallelContext
    from atom_vllm_plugin.parallel import VllmTensorParallel
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    res: dict = {}
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        ensure_model_parallel_initialized(world, 1)
        ctx = VllmTensorParallel()
        res["protocol"] = isinstance(ctx, ParallelContext)
        res["rank"], res["world_size"] = ctx.rank, ctx.world_size
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank
        res["all_reduce"] = ctx.all_reduce(x.clone()).tolist()
        res["all_gather_last"] = ctx.all_gather(x.clone(), dim=-1).tolist()
        res["all_gather_0"] = ctx.all_gather(x.clone(), dim=0).tolist()
        res["broadcast_1"] = ctx.broadcast(x.clone(), src=world - 1).tolist()

        def body(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            # a row-parallel matmul then a vocab-style gather: the two collectives a sharded layer uses
            y = ctx.all_reduce(h @ w)
            return ctx.all_gather(torch.relu(y), dim=-1)

        h = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
        w = torch.randn(8, 6, generator=torch.Generator().manual_seed(1 + rank))
        eager = body(h, w)
        compiled = torch.compile(body, fullgraph=True, dynamic=True)(h, w)
        res["compiled_equal"] = bool(torch.equal(eager, compiled))
        res["compiled_shape"] = list(compiled.shape)
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
