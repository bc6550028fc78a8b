"""The plugin's layers and host-planned kernels as vLLM custom ops, so that vLLM's torch.compile treats
them as opaque calls.

vLLM compiles a model decorated with ``support_torch_compile`` in one Dynamo trace (``fullgraph=True``, guards
dropped). What happens between the token mixers (norms, projections, RoPE, residuals) is traced and compiled;
the token mixers are not traceable (they read vLLM's per-step metadata from the forward context and branch on
it on the host) and are registered here, like vLLM's own ``unified_attention_with_output`` and
``qwen_gdn_attention_core``, with :func:`vllm.utils.torch_utils.direct_register_custom_op`:

- ``vllm::atom_attention_with_output(q, k, v, output, layer_name)``: KV write + paged attention of one layer;
- ``vllm::atom_gdn_core(mixed_qkv, b, a, conv_weight, conv_bias, A_log, dt_bias, output, layer_name)``: the
  GDN pipeline of one layer (conv, gating, prefill / decode / verify delta rule, state updates).

Some kernels choose their launch plan on the host from the token count: traced, the plan of the trace's
(large, dummy) token count would be frozen into the graph, and every decode step would run the prefill
plan. They go through ops of their own, so that the plan is chosen from the token count at run time:

- ``vllm::atom_linear(x, weight, bias)``: the dense linear (one GEMV launch at decode-sized ``M``, else
  ``F.linear``; GDN's ``in_proj_ba``);
- ``vllm::atom_fp8_linear(x, w_fp8, scale_inv, block, bias, tickets)``: the W8A8 block-scaled linear
  (one-launch decode kernel, split-K or prefill tiles by ``M``);
- ``vllm::atom_gated_norm_fp8_linear(o, z, norm_weight, eps, w_fp8, scale_inv, block, bias, tickets)``: the
  GDN output's gated RMS norm and its FP8 ``out_proj`` (one launch at decode-sized ``T``, else the norm and
  ``fp8_linear``);
- ``vllm::atom_moe_gate_router(x, gate_weight, num_experts, top_k, renormalize, num_shared, tickets)``: the
  router's Linear + top-k (one fused launch at decode-sized ``T``) -> ``(weights, ids)``;
- ``vllm::atom_moe_experts(x, weights, ids, w13, w2)`` / ``vllm::atom_moe_experts_fp8(x, weights, ids, w13,
  w13_scale_inv, w2, w2_scale_inv, block, tickets)``: the routed experts (the reference backend groups
  tokens by expert on the host, which Dynamo cannot trace; the Triton FP8 experts take the pair path or
  the aligned path by ``T``).

Where the bound backend of an elementwise op is Triton (CUDA / ROCm), it goes through an op too:

- ``vllm::atom_rms_norm(x, weight, eps)``, ``vllm::atom_add_rms_norm(x, residual, weight, eps)`` ->
  ``(y, x + residual)``, ``vllm::atom_gated_rms_norm(x, z, weight, eps)``, ``vllm::atom_rope(q, k,
  positions, rotary_dim, theta)`` -> ``(q, k)``, ``vllm::atom_silu_and_mul(x)``: Dynamo would otherwise
  trace the Triton launches as user-defined Triton kernels, which inductor's post-grad pass
  (``decompose_triton_kernel_wrapper_functional``, torch 2.11) fails to rewrite for these launchers. The
  reference (plain torch) implementations stay traced, for inductor to fuse.

These call the backend kernels bound by :func:`compilable_kernels` (``atom_kernels.Kernels``, per device
type and dtype) and return new tensors; they stay inside the compiled pieces. ``linear`` and
``moe_gate_router`` take their ops only where their bound backend is Triton (:data:`_PLANNED_OPS`):
the other backends' forms are plain torch with no plan (``F.linear``; the router's Linear, softmax and
top-k), which vLLM's compile traces and inductor fuses like stock vLLM's router, instead of an opaque call
whose body runs op by op in eager torch on every step. The FP8 linears and the routed experts keep their
ops on every backend (the reference and cpu experts group tokens on the host).

The two layer ops write into an ``output`` allocated by the compiled graph (the "with output" convention of
vLLM's attention op), so with piecewise CUDA graphs the next piece reads a buffer of the graph's memory pool.
They are the plugin's splitting ops (:data:`SPLITTING_OPS`, added to ``compilation_config.splitting_ops``
by :func:`atom_vllm_plugin.models.common.add_splitting_ops`).
The layer ops find their layer in vLLM's forward context (``no_compile_layers``, filled from the static
forward context the layers register in), as vLLM's ops do.
"""

from __future__ import annotations

import inspect

import torch
from vllm.utils.torch_utils import direct_register_custom_op

SPLITTING_OPS = ("vllm::atom_attention_with_output", "vllm::atom_gdn_core")
"""The plugin's ops that split vLLM's compiled graph (attention-like: per-step metadata, caches)."""


def _layer(layer_name: str):
    """The layer registered as ``layer_name``, or None outside a forward context (no metadata: zeros out)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return get_forward_context().no_compile_layers[layer_name]


# ---- full attention ---------------------------------------------------------------------------------
def atom_attention_with_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    layer = _layer(layer_name)
    if layer is None:
        output.zero_()
        return
    layer.run_into(output, q, k, v)


# ---- Gated DeltaNet ---------------------------------------------------------------------------------
def atom_gdn_core(
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    from atom_models.gdn_meta import GDNWeights

    layer = _layer(layer_name)
    if layer is None:
        output.zero_()
        return
    weights = GDNWeights(conv_weight=conv_weight, conv_bias=conv_bias, A_log=A_log, dt_bias=dt_bias)
    layer.run_into(output, mixed_qkv, b, a, weights)


# ---- kernels behind ops: bound backend, plans chosen at run time -----------------------------------
_KERNELS: dict[tuple[str, torch.dtype], object] = {}
"""The backend kernels (``atom_kernels.Kernels``) the kernel ops call, per (device type, dtype)."""


def _kernels(x: torch.Tensor):
    try:
        return _KERNELS[(x.device.type, x.dtype)]
    except KeyError:
        raise RuntimeError(
            f"atom kernel ops: no kernels bound for {x.device.type}/{x.dtype} (see compilable_kernels)"
        ) from None


def atom_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _kernels(x).linear(x, weight, bias)


# ``tickets`` (fp8_linear, gated_norm_fp8_linear, moe_gate_router, moe_experts_fp8): int32 counters the kernels take atomically and return to zero
# within the launch, so the op leaves them as it found them. They are not declared mutated: that would make
# functionalisation clone them (a copy and a zeroed buffer per call) and give the graph a write-back.
def atom_fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: list[int],
    bias: torch.Tensor | None,
    tickets: torch.Tensor | None,
) -> torch.Tensor:
    return _kernels(x).fp8_linear(x, w_fp8, scale_inv, tuple(block), bias, tickets=tickets)


def atom_gated_norm_fp8_linear(
    o: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: list[int],
    bias: torch.Tensor | None,
    tickets: torch.Tensor | None,
) -> torch.Tensor:
    return _kernels(o).gated_norm_fp8_linear(
        o, z, norm_weight, eps, w_fp8, scale_inv, tuple(block), bias, tickets=tickets
    )


def atom_moe_gate_router(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    renormalize: bool,
    num_shared: int,
    tickets: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels(x).moe_gate_router(
        x, gate_weight, num_experts, top_k, renormalize, num_shared, tickets=tickets
    )


def atom_moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    return _kernels(x).moe_experts(x, weights, ids, w13, w2)


def atom_moe_experts_fp8(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    block: list[int],
    tickets: torch.Tensor | None,
) -> torch.Tensor:
    return _kernels(x).moe_experts_fp8(
        x, weights, ids, w13, w13_scale_inv, w2, w2_scale_inv, tuple(block), tickets=tickets
    )


def atom_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _kernels(x).rms_norm(x, weight, eps)


def atom_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels(x).rms_norm(x, weight, eps, residual)


def atom_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _kernels(x).gated_rms_norm(x, z, weight, eps)


def atom_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels(q).rope(q, k, positions, rotary_dim, theta)


def atom_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _kernels(x).silu_and_mul(x)


# The ``Kernels`` fields (reference signatures) that call the ops above.
def _rms_norm_op(x, weight, eps, residual=None):
    if residual is None:
        return torch.ops.vllm.atom_rms_norm(x, weight, float(eps))
    return torch.ops.vllm.atom_add_rms_norm(x, residual, weight, float(eps))


def _gated_rms_norm_op(x, z, weight, eps):
    return torch.ops.vllm.atom_gated_rms_norm(x, z, weight, float(eps))


def _rope_op(q, k, positions, rotary_dim, theta):
    return torch.ops.vllm.atom_rope(q, k, positions, int(rotary_dim), float(theta))


def _silu_and_mul_op(x):
    return torch.ops.vllm.atom_silu_and_mul(x)


_ELEMENTWISE_OPS = {
    "rms_norm": _rms_norm_op,
    "gated_rms_norm": _gated_rms_norm_op,
    "rope": _rope_op,
    "silu_and_mul": _silu_and_mul_op,
}
"""Kernels fields routed through their op where the bound backend is Triton (module docstring)."""


def _linear_op(x, weight, bias=None):
    return torch.ops.vllm.atom_linear(x, weight, bias)


def _fp8_linear_op(x, w_fp8, scale_inv, block=(128, 128), bias=None, *, tickets=None):
    return torch.ops.vllm.atom_fp8_linear(x, w_fp8, scale_inv, [int(block[0]), int(block[1])], bias, tickets)


def _gated_norm_fp8_linear_op(
    o, z, norm_weight, eps, w_fp8, scale_inv, block=(128, 128), bias=None, *, tickets=None
):
    return torch.ops.vllm.atom_gated_norm_fp8_linear(
        o, z, norm_weight, float(eps), w_fp8, scale_inv, [int(block[0]), int(block[1])], bias, tickets
    )


def _gate_router_op(x, gate_weight, num_experts, top_k, renormalize, num_shared=0, *, tickets=None):
    return torch.ops.vllm.atom_moe_gate_router(
        x, gate_weight, int(num_experts), int(top_k), bool(renormalize), int(num_shared), tickets
    )


def _experts_op(x, weights, ids, w13, w2):
    return torch.ops.vllm.atom_moe_experts(x, weights, ids, w13, w2)


def _experts_fp8_op(x, weights, ids, w13, w13_scale_inv, w2, w2_scale_inv, block=(128, 128), *, tickets=None):
    return torch.ops.vllm.atom_moe_experts_fp8(
        x, weights, ids, w13, w13_scale_inv, w2, w2_scale_inv, [int(block[0]), int(block[1])], tickets
    )


_PLANNED_OPS = {"linear": _linear_op, "moe_gate_router": _gate_router_op}
"""Kernels routed through their op only where the bound backend is Triton (it picks a launch plan on the
host from the token count); on other backends plain torch that the compiled graph traces."""


def compilable_kernels(kernels):
    """``kernels`` with ``fp8_linear``, ``gated_norm_fp8_linear``, the routed experts and, where Triton
    implements them, the elementwise ops, ``linear`` and ``moe_gate_router`` going through the opaque ops
    above (same backend underneath)."""
    import dataclasses

    register_ops()
    _KERNELS[(kernels.device.type, kernels.dtype)] = kernels
    triton_bound = {**_ELEMENTWISE_OPS, **_PLANNED_OPS}
    triton_ops = {name: op for name, op in triton_bound.items() if kernels.backends.get(name) == "triton"}
    return dataclasses.replace(
        kernels,
        **triton_ops,
        fp8_linear=_fp8_linear_op,
        gated_norm_fp8_linear=_gated_norm_fp8_linear_op,
        moe_experts=_experts_op,
        moe_experts_fp8=_experts_fp8_op,
    )


def _outputs(real, rule):
    """The fake impl of the op ``real``: ``rule`` called with ``real``'s arguments by name (it names those it
    reads and takes the rest as ``**_``), returning new empty tensors of the real outputs' shapes, dtypes and
    strides (checked against the real op by ``torch.library.opcheck`` in the tests)."""
    signature = inspect.signature(real)

    def fake(*args, **kwargs):
        return rule(**signature.bind(*args, **kwargs).arguments)

    return fake


def _router_outputs(x: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((x.shape[0], columns), dtype=torch.float32), x.new_empty(
        (x.shape[0], columns), dtype=torch.int64
    )


_OPS = (
    # (op name, function, arguments it writes in place, its outputs from its arguments)
    ("atom_attention_with_output", atom_attention_with_output, ["output"], lambda **_: None),
    ("atom_gdn_core", atom_gdn_core, ["output"], lambda **_: None),
    ("atom_linear", atom_linear, None, lambda x, weight, **_: x.new_empty((*x.shape[:-1], weight.shape[0]))),
    (
        "atom_fp8_linear",
        atom_fp8_linear,
        None,
        lambda x, w_fp8, **_: x.new_empty((*x.shape[:-1], w_fp8.shape[0])),
    ),
    (
        "atom_gated_norm_fp8_linear",
        atom_gated_norm_fp8_linear,
        None,
        lambda o, w_fp8, **_: o.new_empty((*o.shape[:-2], w_fp8.shape[0])),
    ),
    (
        "atom_moe_gate_router",
        atom_moe_gate_router,
        None,  # routed columns, then the shared pseudo-experts
        lambda x, top_k, num_shared, **_: _router_outputs(x, top_k + num_shared),
    ),
    ("atom_moe_experts", atom_moe_experts, None, lambda x, **_: torch.empty_like(x)),
    ("atom_moe_experts_fp8", atom_moe_experts_fp8, None, lambda x, **_: torch.empty_like(x)),
    ("atom_rms_norm", atom_rms_norm, None, lambda x, **_: x.new_empty(x.shape)),
    (
        "atom_add_rms_norm",
        atom_add_rms_norm,
        None,
        lambda x, residual, *_, **__: (x.new_empty(x.shape), residual.new_empty(x.shape)),
    ),
    ("atom_gated_rms_norm", atom_gated_rms_norm, None, lambda x, **_: x.new_empty(x.shape)),
    ("atom_rope", atom_rope, None, lambda q, k, **_: (q.new_empty(q.shape), k.new_empty(k.shape))),
    ("atom_silu_and_mul", atom_silu_and_mul, None, lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2))),
)
"""Every op of this module: ``vllm::<op name>``."""

_registered = False


def register_ops() -> None:
    """Register the ops once per process (``vllm::`` namespace, the platform's dispatch key)."""
    global _registered
    if _registered:
        return
    for name, func, mutates, rule in _OPS:
        direct_register_custom_op(
            op_name=name, op_func=func, mutates_args=mutates, fake_impl=_outputs(func, rule)
        )
    _registered = True
