"""``Kernels``: every op resolved once for a (device, dtype), and :func:`select_kernels`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from atom_core.envs import forced_kernel_backend

from atom_kernels import registry
from atom_kernels import signatures as sig


@dataclass(frozen=True)
class Kernels:
    """The resolved op callables, typed by :mod:`atom_kernels.signatures` (semantics: docs/kernel-api.md)."""

    device: torch.device
    dtype: torch.dtype
    rms_norm: sig.RmsNorm
    gated_rms_norm: sig.GatedRmsNorm
    rope: sig.Rope
    silu_and_mul: sig.SiluAndMul
    linear: sig.Linear
    moe_router: sig.MoeRouter
    moe_gate_router: sig.MoeGateRouter
    moe_experts: sig.MoeExperts
    moe_experts_fp8: sig.MoeExpertsFp8
    gdn_gating: sig.GdnGating
    l2norm: sig.L2Norm
    causal_conv1d_varlen: sig.CausalConv1dVarlen
    causal_conv1d_update: sig.CausalConv1dUpdate
    gated_delta_rule_chunked: sig.GatedDeltaRuleChunked
    gated_delta_rule_recurrent: sig.GatedDeltaRuleRecurrent
    gated_delta_rule_verify: sig.GatedDeltaRuleVerify
    kv_cache_write: sig.KvCacheWrite
    paged_attention: sig.PagedAttention
    fp8_block_dequant: sig.Fp8BlockDequant
    fp8_act_quant: sig.Fp8ActQuant
    fp8_linear: sig.Fp8Linear
    gated_norm_fp8_linear: sig.GatedNormFp8Linear
    fp8_kv_quant: sig.Fp8KvQuant
    fp8_kv_dequant: sig.Fp8KvDequant
    backends: Mapping[str, str] = field(repr=False, compare=False, default_factory=dict)

    def backend_of(self, op: str) -> str:
        """The backend name serving ``op`` ("reference", "triton", ...)."""
        if op not in self.backends:
            raise ValueError(f"unknown op {op!r}; expected one of {list(registry.OPS)}")
        return self.backends[op]


_OP_FIELDS = tuple(
    f.name for f in dataclasses.fields(Kernels) if f.name not in ("device", "dtype", "backends")
)
if _OP_FIELDS != registry.OPS:
    raise RuntimeError(f"Kernels fields {_OP_FIELDS} do not match registry.OPS {registry.OPS}")


def select_kernels(
    device: torch.device | str,
    dtype: torch.dtype,
    backend: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Kernels:
    """Resolve every op once for (device, dtype).

    ``backend=None`` picks per op the highest-priority available backend (``reference`` is always
    available); ``backend="<name>"``, or else env ``ATOM_KERNEL_BACKEND``, forces that backend for
    every op and raises :class:`~atom_kernels.registry.KernelBackendError` naming the first op that
    lacks it. ``environ`` replaces ``os.environ`` (tests).
    """
    device = torch.device(device)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"select_kernels: dtype must be a torch.dtype, got {dtype!r}")
    forced = backend if backend is not None else forced_kernel_backend(environ)
    if forced is not None and forced not in registry.BACKEND_MODULES:
        raise ValueError(
            f"select_kernels: unknown backend {forced!r}; expected one of {list(registry.BACKEND_MODULES)}"
        )
    impls = {op: registry.resolve(op, device, dtype, forced) for op in registry.OPS}
    return Kernels(
        device=device,
        dtype=dtype,
        backends=MappingProxyType({op: impl.backend for op, impl in impls.items()}),
        **{op: impl.fn for op, impl in impls.items()},
    )
