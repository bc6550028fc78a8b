"""The ``cpu`` backend: plain torch like ``reference``, with faster forms of the ops whose reference form
is slow on a CPU (the recurrent state stepped token by token, sequences looped in Python, row copies through
a temporary, bf16 weights reordered by oneDNN on every product): same contracts, same float32 math up to the order of the sums. :data:`CPU_OPS` are those; every other op is the
reference's own function, so the backend is complete (``ATOM_KERNEL_BACKEND=cpu`` works, and the
conformance tests run each multi-op test on it). Available on CPU tensors only; priority 1, so it is the
default on a CPU.
"""

from __future__ import annotations

import torch

from atom_kernels.backends.reference import REFERENCE_OPS
from atom_kernels.ops.conv1d import cpu as conv1d
from atom_kernels.ops.copy_rows import cpu as copy_rows
from atom_kernels.ops.gated_delta_rule import cpu as gdr
from atom_kernels.ops.gated_delta_rule import cpu_chunked as gdr_chunked
from atom_kernels.ops.linear import cpu as linear
from atom_kernels.ops.moe import cpu as moe
from atom_kernels.ops.paged_attention import cpu as paged
from atom_kernels.registry import register

BACKEND = "cpu"
PRIORITY = 1

CPU_OPS = {
    "causal_conv1d_varlen": conv1d.causal_conv1d_varlen,
    "causal_conv1d_update": conv1d.causal_conv1d_update,
    "gated_delta_rule_chunked": gdr_chunked.gated_delta_rule_chunked,
    "gated_delta_rule_recurrent": gdr.gated_delta_rule_recurrent,
    "gated_delta_rule_verify": gdr.gated_delta_rule_verify,
    "paged_attention": paged.paged_attention,
    "moe_experts": moe.moe_experts,
    "copy_rows": copy_rows.copy_rows,
    "linear": linear.linear,
}
"""The ops with a CPU form of their own."""


def on_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu"


for _op, _fn in {**REFERENCE_OPS, **CPU_OPS}.items():
    register(_op, BACKEND, _fn, available=on_cpu, priority=PRIORITY)
