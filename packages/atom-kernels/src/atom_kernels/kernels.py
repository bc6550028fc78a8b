"""``Kernels``: every op resolved once for a (device, dtype), and :func:`select_kernels`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from atom_core.envs import forced_kernel_backend

from atom_kernels import registry

logger = logging.getLogger(__name__)

Op = Callable[..., Any]
"""An op's callable. Its signature is the reference implementation's (``atom_kernels.ops.<family>.reference``,
the spec); every backend takes the same parameters and may add keyword-only ones with defaults
(``tests/test_kernels_registry.py`` checks every registered implementation)."""


@dataclass(frozen=True)
class Kernels:
    """The resolved op callables, one per name of :data:`atom_kernels.registry.OPS`, each with its reference
    implementation's signature (:data:`Op`; semantics: docs/kernel-api.md)."""

    device: torch.device
    dtype: torch.dtype
    rms_norm: Op
    gated_rms_norm: Op
    rope: Op
    silu_and_mul: Op
    linear: Op
    moe_router: Op
    moe_gate_router: Op
    moe_experts: Op
    moe_experts_fp8: Op
    gdn_gating: Op
    l2norm: Op
    causal_conv1d_varlen: Op
    causal_conv1d_update: Op
    gated_delta_rule_chunked: Op
    gated_delta_rule_recurrent: Op
    gated_delta_rule_verify: Op
    kv_cache_write: Op
    paged_attention: Op
    fp8_block_dequant: Op
    fp8_act_quant: Op
    fp8_linear: Op
    gated_norm_fp8_linear: Op
    rms_norm_fp8_linear: Op
    fp8_kv_quant: Op
    fp8_kv_dequant: Op
    copy_rows: Op
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
    if forced is None:
        for message in slow_fallbacks(device, dtype, {op: impl.backend for op, impl in impls.items()}):
            logger.warning(message)
    return Kernels(
        device=device,
        dtype=dtype,
        backends=MappingProxyType({op: impl.backend for op, impl in impls.items()}),
        **{op: impl.fn for op, impl in impls.items()},
    )


def slow_fallbacks(device: torch.device, dtype: torch.dtype, backends: Mapping[str, str]) -> list[str]:
    """Warnings for ops that fall back to the torch reference on a GPU where a fast backend exists but a
    dependency is missing: the bf16/fp16 chunked GDN prefill needs fla-core (``atom-kernels[fla]``, part of
    ``atom-vllm-plugin[cuda]``); without it every prompt's GDN layers run the reference's per-chunk torch ops."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return []
    if backends.get("gated_delta_rule_chunked") != "reference":
        return []
    return [
        f"gated_delta_rule_chunked (GDN prefill) runs on the torch reference backend on {device} ({dtype}): "
        "fla-core is not installed, so prompts prefill far slower than decode would suggest; install it with "
        "pip install 'atom-kernels[fla]' (included in 'atom-vllm-plugin[cuda]')"
    ]
