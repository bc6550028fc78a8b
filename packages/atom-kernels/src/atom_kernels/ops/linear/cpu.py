"""CPU dense linear on a bf16 weight packed once into oneDNN's blocked layout.

``aten::mm`` on a plain ``[N, K]`` bf16 weight lets oneDNN reorder the weight into its blocked (AMX / AVX-512
VNNI) layout on every call; at decode and verify row counts that reorder is most of the call. The owner of a
linear asks :func:`pack_linear_weight` for a packed copy once, after loading, and passes it to
:func:`linear` as ``packed``: the product is ``mkldnn::_linear_pointwise`` on the packed weight (the call
inductor's weight freezing makes), bit-equal to ``F.linear`` (same oneDNN kernel, float32 accumulation,
one rounding; ``test_kernels_linear_cpu.py``).

The packed weight is an opaque ``torch._mkldnn`` tensor that inductor cannot lower an op on, so the product
runs behind the operator ``atom_kernels::linear_packed`` (a fake implementation gives the output's shape):
Dynamo traces it as one call and the compiled graph calls oneDNN with the packed weight it was given.

Only bf16 weights are packed (:data:`PACKED_DTYPES`): float32 ``F.linear`` runs MKL's sgemm, whose sums a
oneDNN float32 primitive does not reproduce bit for bit at every shape, and the float32 path is the exact one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from atom_kernels.ops.linear.checks import check_linear

PACKED_DTYPES = (torch.bfloat16,)
"""Weight dtypes :func:`pack_linear_weight` packs (others: None, and :func:`linear` runs ``F.linear``)."""

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
    """A oneDNN-packed copy of ``weight`` (``[N, K]``, CPU) for :func:`linear`'s ``packed``; None where the
    weight is not packed (a dtype outside :data:`PACKED_DTYPES`, fewer than :data:`PACK_MIN_ROWS` rows, not
    on the CPU, or oneDNN unable to pack it on this CPU: :func:`packing_supported`)."""
    if (
        weight.dim() != 2
        or weight.shape[0] < PACK_MIN_ROWS
        or weight.device.type != "cpu"
        or not packing_supported(weight.dtype)
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


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
_LINEAR_PACKED = (
    torch.ops.atom_kernels.linear_packed.default
)  # the overload (the packet resolves it per call)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` (the reference's contract); ``packed``: ``weight`` packed by
    :func:`pack_linear_weight` (None: ``F.linear`` on ``weight``)."""
    check_linear(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return _LINEAR_PACKED(x, packed, bias, weight.shape[0])
