"""The ``triton`` backend: Triton kernels for CUDA GPUs (the same sources compile for ROCm).

Imported lazily by :mod:`atom_kernels.registry` the first time the ``triton`` backend is asked about;
an ``ImportError`` here (no triton) makes the backend unavailable. Each op module is imported here, and
its function registered with :data:`PRIORITY` (above ``reference``'s 0) and :func:`on_gpu`.

Keep this a flat list of ``register`` calls, one line per op, so every backend author appends theirs.

Debugging on a CPU machine: with ``TRITON_INTERPRET=1`` in the environment, :func:`on_gpu` also accepts
CPU tensors, so the conformance tests run these kernels through Triton's interpreter (slow; small shapes).
"""

from __future__ import annotations

import os

import torch
import triton  # noqa: F401  (an ImportError here marks the whole backend unavailable)

from atom_kernels.registry import register  # noqa: F401  (used by the register lines below)

BACKEND = "triton"
PRIORITY = 10
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def on_gpu(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA/ROCm device (torch calls both "cuda") and a float dtype; CPU only under TRITON_INTERPRET=1."""
    if dtype not in DTYPES:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


# Gated DeltaNet (issue 6): gating, l2norm, causal conv1d, gated delta rule.

# Norms, RoPE, SwiGLU, MoE experts (issue 7).
from atom_kernels.ops.activation import triton as _activation  # noqa: E402
from atom_kernels.ops.moe import triton as _moe  # noqa: E402
from atom_kernels.ops.norm import triton as _norm  # noqa: E402
from atom_kernels.ops.rope import triton as _rope  # noqa: E402

register("rms_norm", BACKEND, _norm.rms_norm, available=on_gpu, priority=PRIORITY)
register("gated_rms_norm", BACKEND, _norm.gated_rms_norm, available=on_gpu, priority=PRIORITY)
register("rope", BACKEND, _rope.rope, available=on_gpu, priority=PRIORITY)
register("silu_and_mul", BACKEND, _activation.silu_and_mul, available=on_gpu, priority=PRIORITY)
register("moe_router", BACKEND, _moe.moe_router, available=on_gpu, priority=PRIORITY)
register("moe_experts", BACKEND, _moe.moe_experts, available=on_gpu, priority=PRIORITY)
