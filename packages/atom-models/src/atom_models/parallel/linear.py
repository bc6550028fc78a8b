"""Linear layers of a tensor-parallel model: column-parallel and row-parallel (built by
:func:`column_parallel_linear` / :func:`row_parallel_linear`).

Both are a :class:`Linear` (``weight[out_local, in_local]`` as in HF checkpoints) with a
:class:`~atom_models.parallel.shard.LinearShard` saying which rows or columns of the full weight this rank
holds and which collective finishes the output:

- column-parallel: ``y_local = x @ W[rows].T``, the rank's output features (optionally all-gathered);
- row-parallel: ``y = all_reduce(x_local @ W[:, cols].T)``, the input features split, the partial sums
  added over the ranks (``reduce_results=False`` leaves the partial sum to the caller, e.g. the MoE block
  which reduces routed + shared experts once). A bias is added on rank 0 only, so the sum has it once.

With ``world_size == 1`` both are a plain linear and the collectives are the identity.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from atom_kernels.ops.linear import PACKED_WEIGHT_BACKENDS, pack_linear_weight
from torch import nn

from atom_models.parallel.context import ParallelContext
from atom_models.parallel.shard import COLUMN, ROW, LinearShard


def local_bias(bias: torch.Tensor | None, shard: LinearShard | None) -> torch.Tensor | None:
    """The bias this rank adds: a row-parallel layer's on rank 0 only (the reduce sums it once)."""
    if bias is None or shard is None or shard.kind != ROW or shard.parallel.rank == 0:
        return bias
    return None


def finish(y: torch.Tensor, shard: LinearShard | None) -> torch.Tensor:
    """The collective a sharded linear's output needs (none for a column-parallel one without gather)."""
    if shard is None:
        return y
    if shard.kind == ROW and shard.reduce:
        return shard.parallel.all_reduce(y)
    if shard.kind == COLUMN and shard.gather:
        return shard.parallel.all_gather(y, -1)
    return y


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)``; ``weight`` is ``[out_features, in_features]`` (this rank's sizes).

    ``shard``: this rank's part of a sharded linear (None: the whole weight on every rank). ``kernels``: an
    ``atom_kernels.Kernels`` whose ``linear`` op computes the product (e.g. a one-launch GEMV at decode
    sizes); None: ``torch.nn.functional.linear``.

    ``packed``: the weight packed once by the kernels (:meth:`hold_packed`, after loading), passed to
    ``kernels.linear`` with ``weight``; None: the weight as it is. ``pack``: whether :meth:`hold_packed` may
    pack the weight (False for a weight its owner reads directly, never through :meth:`forward`: the MoE
    router's). Once packed, the original weight may be released (``weight_released``): ``weight`` is then
    a shape-only stand-in (its dtype, device and ``[out, in]`` shape, one element of storage, so its values
    mean nothing), which ``kernels.linear`` checks the input against; the product reads only ``packed``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        shard: LinearShard | None = None,
        kernels=None,
        pack: bool = True,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.shard = shard
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.pack = pack
        self.packed: torch.Tensor | None = None
        self.weight_released = False

    def hold_packed(self, kernels, release: bool = False) -> int:
        """Hold the (loaded) weight packed by ``kernels``' ``linear`` backend, for every later call, where
        that backend takes packed weights (:data:`~atom_kernels.ops.linear.PACKED_WEIGHT_BACKENDS`) and
        packs this one; the product is the same. ``release``: then drop the original weight (the caller
        knows nothing else holds it; see the class), which the product never reads again. Call again after
        the weight changes (not possible once released: loading into the stand-in raises). Returns the bytes of the packed copy (0: nothing
        packed, also for a weight already released)."""
        if (
            not self.pack
            or self.weight_released
            or kernels.backends.get("linear") not in PACKED_WEIGHT_BACKENDS
        ):
            return 0
        packed = pack_linear_weight(self.weight)
        if packed is None:
            return 0
        self.kernels, self.packed = kernels, packed
        # oneDNN's blocked copy holds the weight's bytes; the float32 copy (CPUs without bf16 packing) twice them
        w = packed if not packed.is_mkldnn else self.weight
        nbytes = w.numel() * w.element_size()
        if release:
            w = self.weight
            stand_in = torch.empty((), dtype=w.dtype, device=w.device).expand(w.shape)
            self.weight = nn.Parameter(stand_in, requires_grad=False)
            self.weight_released = True
        return nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = local_bias(self.bias, self.shard)
        if self.packed is not None:
            return finish(self.kernels.linear(x, self.weight, bias, packed=self.packed), self.shard)
        if self.kernels is None:
            return finish(F.linear(x, self.weight, bias), self.shard)
        return finish(self.kernels.linear(x, self.weight, bias), self.shard)

    def extra_repr(self) -> str:
        s = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        if self.shard is not None and self.shard.is_sharded:
            s += f", {self.shard.kind}-parallel {list(self.shard.ranges)} of {list(self.shard.parts)}"
        return s


def hold_packed_linears(model: nn.Module, kernels) -> int:
    """:meth:`Linear.hold_packed` on every :class:`Linear` of ``model``; call once, after the weights are
    loaded. A packed linear's original weight is released unless ``model`` holds that tensor in another
    place too (tied embeddings: ``lm_head.weight`` is the embedding's). A linear shared with a model
    packed before (the MTP draft's lm_head is the target's) is left as that call made it. Returns the
    bytes of the packed copies made (0 where ``kernels``' ``linear`` backend takes no packed weights)."""
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return sum(
        m.hold_packed(kernels, release=holders[id(m.weight)] == 1)
        for m in model.modules()
        if isinstance(m, Linear)
    )


def column_parallel_linear(
    in_features: int,
    out_features: int,
    parallel: ParallelContext,
    *,
    parts: tuple[int, ...] | None = None,
    ranges: tuple[tuple[int, int], ...] | None = None,
    gather_output: bool = False,
    bias: bool = False,
    dtype: torch.dtype | None = None,
    kernels=None,
) -> Linear:
    """A :class:`Linear` holding this rank's output rows: ``parts`` (default ``(out_features,)``, the fused
    checkpoint tensors' row counts) each split evenly, or the explicit ``ranges`` of each part this rank
    holds (KV heads). ``gather_output``: all-gather the local outputs into the full ``out_features``.
    ``kernels``: see :class:`Linear`."""
    parts = (out_features,) if parts is None else tuple(parts)
    if sum(parts) != out_features:
        raise ValueError(f"column-parallel linear: parts {parts} do not add up to {out_features} rows")
    if ranges is None:
        shard = LinearShard.even(COLUMN, parallel, parts, gather=gather_output)
    else:
        shard = LinearShard(COLUMN, parallel, parts, tuple(ranges), gather=gather_output)
    return Linear(in_features, shard.local_size, bias=bias, dtype=dtype, shard=shard, kernels=kernels)


def row_parallel_linear(
    in_features: int,
    out_features: int,
    parallel: ParallelContext,
    *,
    reduce_results: bool = True,
    bias: bool = False,
    dtype: torch.dtype | None = None,
) -> Linear:
    """A :class:`Linear` holding this rank's input columns (split evenly); its output is all-reduced unless
    ``reduce_results=False``."""
    shard = LinearShard.even(ROW, parallel, (in_features,), reduce=reduce_results)
    return Linear(shard.local_size, out_features, bias=bias, dtype=dtype, shard=shard)
