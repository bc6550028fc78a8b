"""The ``triton`` backend: Triton kernels for CUDA GPUs (the same sources compile for ROCm).

Imported lazily by :mod:`atom_kernels.registry` the first time the ``triton`` backend is asked about;
an ``ImportError`` here (no triton) makes the backend unavailable. Each op module is imported here, and
its function registered with :data:`PRIORITY` (above ``reference``'s 0) and :func:`on_gpu`.

Keep this a flat list of ``register`` calls, one line per op, so every backend author appends theirs.

Debugging on a CPU machine: with ``TRITON_INTERPRET=1`` in the environment, :func:`on_gpu` also accepts
CPU tensors, so the conformance tests run these kernels through Triton's interpreter (slow; small shapes).
"""

from __future__ import annotations

import importlib.util

import torch
import triton  # noqa: F401  (an ImportError here marks the whole backend unavailable)

from atom_kernels.ops._triton_env import interpreting
from atom_kernels.ops.conv1d import triton as conv1d
from atom_kernels.ops.gated_delta_rule import triton as gdr
from atom_kernels.ops.gated_delta_rule import triton_verify as gdr_verify
from atom_kernels.ops.gdn_gating import triton as gdn_gating
from atom_kernels.ops.l2norm import triton as l2norm
from atom_kernels.registry import register

BACKEND = "triton"
PRIORITY = 10
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def on_gpu(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA/ROCm device (torch calls both "cuda") and a float dtype; CPU only under TRITON_INTERPRET=1."""
    if dtype not in DTYPES:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and interpreting()


def on_gpu_with_fla(device: torch.device, dtype: torch.dtype) -> bool:
    """A real GPU (fla-core autotunes: not under the interpreter), bf16/fp16 activations, fla-core installed.

    Not float32: fla-core's chunked kernels run float32 dots in tf32 (max error 3e-4 to 5e-4 on the
    conformance tests, against the contract's float32 tolerance of 2e-5), so float32 prefill stays on the
    reference.
    """
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and on_gpu(device, dtype)
        and importlib.util.find_spec("fla") is not None
    )


# Gated DeltaNet: gating, l2norm, causal conv1d, gated delta rule.
register("gdn_gating", BACKEND, gdn_gating.gdn_gating, available=on_gpu, priority=PRIORITY)
register("l2norm", BACKEND, l2norm.l2norm, available=on_gpu, priority=PRIORITY)
register("causal_conv1d_varlen", BACKEND, conv1d.causal_conv1d_varlen, available=on_gpu, priority=PRIORITY)
register("causal_conv1d_update", BACKEND, conv1d.causal_conv1d_update, available=on_gpu, priority=PRIORITY)
register(
    "gated_delta_rule_recurrent", BACKEND, gdr.gated_delta_rule_recurrent, available=on_gpu, priority=PRIORITY
)
register(
    "gated_delta_rule_verify",
    BACKEND,
    gdr_verify.gated_delta_rule_verify,
    available=on_gpu,
    priority=PRIORITY,
)
register(
    "gated_delta_rule_chunked",
    BACKEND,
    gdr.gated_delta_rule_chunked,
    available=on_gpu_with_fla,
    priority=PRIORITY,
)

# Dense linear, norms, RoPE, SwiGLU, MoE experts.
from atom_kernels.ops.activation import triton as _activation  # noqa: E402
from atom_kernels.ops.linear import triton as _linear  # noqa: E402
from atom_kernels.ops.moe import triton as _moe  # noqa: E402
from atom_kernels.ops.moe import triton_gate_router as _moe_gate  # noqa: E402
from atom_kernels.ops.norm import triton as _norm  # noqa: E402
from atom_kernels.ops.rope import triton as _rope  # noqa: E402

register("rms_norm", BACKEND, _norm.rms_norm, available=on_gpu, priority=PRIORITY)
register("gated_rms_norm", BACKEND, _norm.gated_rms_norm, available=on_gpu, priority=PRIORITY)
register("rope", BACKEND, _rope.rope, available=on_gpu, priority=PRIORITY)
register("silu_and_mul", BACKEND, _activation.silu_and_mul, available=on_gpu, priority=PRIORITY)
register("linear", BACKEND, _linear.linear, available=on_gpu, priority=PRIORITY)
register("moe_router", BACKEND, _moe.moe_router, available=on_gpu, priority=PRIORITY)
register("moe_gate_router", BACKEND, _moe_gate.moe_gate_router, available=on_gpu, priority=PRIORITY)
register("moe_experts", BACKEND, _moe.moe_experts, available=on_gpu, priority=PRIORITY)

# Paged KV cache write and paged attention.
from atom_kernels.ops.paged_attention import triton as _paged  # noqa: E402

register("kv_cache_write", BACKEND, _paged.kv_cache_write, available=on_gpu, priority=PRIORITY)
register("paged_attention", BACKEND, _paged.paged_attention, available=on_gpu, priority=PRIORITY)

# Row copies across many tensors (GDN state slots of every layer) in one launch.
from atom_kernels.ops.copy_rows import triton as _copy_rows  # noqa: E402

register("copy_rows", BACKEND, _copy_rows.copy_rows, available=on_gpu, priority=PRIORITY)

# FP8: W8A8 block-scaled GEMM (alone, after the GDN gated norm, after the residual add + RMS norm), FP8 fused MoE, block dequant,
# per-tensor KV quant. Real GPUs only: Triton 3.9's interpreter flushes e4m3 subnormals to zero and does
# not saturate, so it cannot run the spec.
from atom_kernels.ops.fp8 import triton as _fp8  # noqa: E402
from atom_kernels.ops.moe import triton_fp8 as _moe_fp8  # noqa: E402


def on_real_gpu(device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`on_gpu` without the interpreter (CUDA/ROCm only)."""
    return device.type == "cuda" and on_gpu(device, dtype)


register("fp8_act_quant", BACKEND, _fp8.fp8_act_quant, available=on_real_gpu, priority=PRIORITY)
register("fp8_linear", BACKEND, _fp8.fp8_linear, available=on_real_gpu, priority=PRIORITY)
register(
    "gated_norm_fp8_linear", BACKEND, _fp8.gated_norm_fp8_linear, available=on_real_gpu, priority=PRIORITY
)
register("rms_norm_fp8_linear", BACKEND, _fp8.rms_norm_fp8_linear, available=on_real_gpu, priority=PRIORITY)
register("fp8_block_dequant", BACKEND, _fp8.fp8_block_dequant, available=on_real_gpu, priority=PRIORITY)
register("fp8_kv_quant", BACKEND, _fp8.fp8_kv_quant, available=on_real_gpu, priority=PRIORITY)
register("fp8_kv_dequant", BACKEND, _fp8.fp8_kv_dequant, available=on_real_gpu, priority=PRIORITY)
register("moe_experts_fp8", BACKEND, _moe_fp8.moe_experts_fp8, available=on_real_gpu, priority=PRIORITY)
