"""CPU dense linear on a bf16 weight prepared once: packed into oneDNN's blocked layout, or held in float32.

``aten::mm`` on a plain ``[N, K]`` bf16 weight lets oneDNN reorder the weight into its blocked (AMX / AVX-512
VNNI) layout on every call; at decode and verify row counts that reorder is most of the call. The owner of a
linear asks :func:`pack_linear_weight` for a prepared copy once, after loading, and passes it to
:func:`linear` as ``packed``:

- where oneDNN packs bf16 (AVX512-BW/VL/DQ or AVX-NE-CONVERT: :func:`packing_supported`), the copy is
  oneDNN's packed weight and the product is ``mkldnn::_linear_pointwise`` on it (the call inductor's weight
  freezing makes): float32 accumulation, one rounding, bit-equal to ``F.linear`` on the AMX Xeon at every
  shape measured, in another summation order on the GPU machine's host CPU at K = 2048 from 16 rows
  (``test_kernels_linear_cpu.py``);
- elsewhere (AVX2 CPUs) ``aten::mm`` on bf16 runs ATen's fallback GEMM, slower than MKL's float32 GEMM at
  every row count (``benchmarks/cpu_linears.py``: up to 2.0x at one token row, 2.1-3.6x at four, 4.6-6.7x at
  sixteen, up to 8.4x beyond), so the copy is the weight in float32 (exact) and the product is ``F.linear``
  in float32 on the tokens widened to float32, rounded once to their dtype (the same float32 sums of the
  same bf16 products, in another order). The bf16 weight is not read again.

The oneDNN-packed weight is an opaque ``torch._mkldnn`` tensor that inductor cannot lower an op on, so that
product runs behind the operator ``atom_kernels::linear_packed`` (a fake implementation gives the output's
shape): Dynamo traces it as one call and the compiled graph calls oneDNN with the packed weight it was
given. The float32 form is plain torch ops, which inductor compiles like any other.

Only bf16 weights are prepared (:data:`PACKED_DTYPES`): float32 ``F.linear`` runs MKL's sgemm, whose sums a
oneDNN float32 primitive does not reproduce bit for bit at every shape, and the float32 path is the exact one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from atom_kernels.ops.linear.checks import check_linear

PACKED_DTYPES = (torch.bfloat16,)
"""Weight dtypes :func:`pack_linear_weight` prepares (others: None, and :func:`linear` runs ``F.linear``)."""

PACK_MIN_ROWS = 16
"""Weights with fewer output rows are not packed: there ``F.linear`` at one row is a matrix-vector product
of ~4 us, where the oneDNN call costs ~20 us at any row count (``benchmarks/cpu_linears.py``: GDN's
``in_proj_ba`` [8, K], the shared expert's gate [1, K])."""


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` linear weights on this CPU (asked once, with a small weight): its bf16
    path needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, and raises on a CPU without them (e.g. AVX2 only)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(PACK_MIN_ROWS, PACK_MIN_ROWS, dtype=dtype))
    except RuntimeError:
        return False
    return True


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The prepared copy of ``weight`` (``[N, K]``, CPU) for :func:`linear`'s ``packed`` (module docstring):
    oneDNN's packed weight where :func:`packing_supported`, else the weight in float32. None where the
    weight is not prepared: a dtype outside :data:`PACKED_DTYPES`, fewer than :data:`PACK_MIN_ROWS` rows, not
    2-D or not on the CPU."""
    if (
        weight.dim() != 2
        or weight.shape[0] < PACK_MIN_ROWS
        or weight.device.type != "cpu"
        or weight.dtype not in PACKED_DTYPES
    ):
        return None
    if packing_supported(weight.dtype):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    return weight.detach().to(torch.float32).contiguous()


def _linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    if x.dim() == 2 and x.is_contiguous() and x.shape[0] > 0:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], n)


def _linear_packed_fake(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


# The op library, defined once at import like any torch operator (never changed afterwards). A plain
# ``Library`` kernel, not ``torch.library.custom_op``: the latter's Python wrappers cost ~30-50 us a call
# here, as much as the product at decode sizes. CompositeExplicitAutograd, because the packed weight's
# ``MkldnnCPU`` key would miss a ``CPU`` kernel.
_LIB = torch.library.Library("atom_kernels", "FRAGMENT")
_LIB.define("linear_packed(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor")
_LIB.impl("linear_packed", _linear_packed, "CompositeExplicitAutograd")
torch.library.register_fake("atom_kernels::linear_packed", _linear_packed_fake, lib=_LIB)
# the overload (the packet resolves it per call)
_LINEAR_PACKED = torch.ops.atom_kernels.linear_packed.default


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` (the reference's contract); ``packed``: ``weight`` prepared by
    :func:`pack_linear_weight` (None: ``F.linear`` on ``weight``)."""
    check_linear(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.dtype != torch.float32:  # oneDNN's packed bf16 weight (its layout is opaque to Dynamo)
        return _LINEAR_PACKED(x, packed, bias, weight.shape[0])
    if packed.shape != weight.shape:
        raise ValueError(
            f"linear: packed must be pack_linear_weight's copy of the [N={weight.shape[0]}, "
            f"K={weight.shape[1]}] weight, got a float32 tensor of shape {tuple(packed.shape)}"
        )
    y = F.linear(x.to(torch.float32), packed, None if bias is None else bias.to(torch.float32))
    return y.to(x.dtype)
