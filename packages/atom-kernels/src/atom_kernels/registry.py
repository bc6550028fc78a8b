"""The kernel backend registry: which implementation of which op, for which (device, dtype).

Every op (see :data:`OPS`) has one or more named backends. A backend registers an implementation with
:func:`register`, giving an availability predicate ``(device, dtype) -> bool`` and a priority; the
highest-priority available backend wins when nothing is forced. :func:`atom_kernels.select_kernels`
resolves every op once and returns a frozen :class:`~atom_kernels.Kernels`.

Backend modules are listed in :data:`BACKEND_MODULES` and imported lazily, the first time a backend
is asked about; importing one registers its ops. A module that fails to import (no triton) makes that
backend unavailable: logged once at debug level, an error only when the backend is
forced.

Module state: :data:`_IMPLS` (the registry table) is the only mutable module-global. It is filled by
``register`` calls made while backend modules are imported (``reference`` at ``import atom_kernels``,
the others lazily) and never changed afterwards; the outcome of each lazy import is cached by
:func:`load_backend` so a missing module is tried and logged once.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

logger = logging.getLogger(__name__)

OPS: tuple[str, ...] = (
    "rms_norm",
    "gated_rms_norm",
    "rope",
    "silu_and_mul",
    "linear",
    "moe_router",
    "moe_gate_router",
    "moe_experts",
    "moe_experts_fp8",
    "gdn_gating",
    "l2norm",
    "causal_conv1d_varlen",
    "causal_conv1d_update",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_verify",
    "kv_cache_write",
    "paged_attention",
    "fp8_block_dequant",
    "fp8_act_quant",
    "fp8_linear",
    "gated_norm_fp8_linear",
    "rms_norm_fp8_linear",
    "fp8_kv_quant",
    "fp8_kv_dequant",
    "copy_rows",
)
"""Every op name; :class:`atom_kernels.Kernels` has exactly one attribute per name, in this order."""

BACKEND_MODULES: Mapping[str, str] = MappingProxyType(
    {
        "reference": "atom_kernels.backends.reference",
        "cpu": "atom_kernels.backends.cpu",
        "triton": "atom_kernels.backends.triton",
    }
)
"""Backend name -> module whose import registers that backend's ops (imported lazily); read-only."""

Predicate = Callable[[torch.device, torch.dtype], bool]


class KernelBackendError(RuntimeError):
    """A forced backend cannot serve an op (missing implementation, failed import, wrong device/dtype)."""


def always_available(device: torch.device, dtype: torch.dtype) -> bool:
    return True


@dataclass(frozen=True)
class KernelImpl:
    op: str
    backend: str
    fn: Callable
    available: Predicate
    priority: int


# op -> backend -> implementation. The only mutable module-global (see the module docstring).
_IMPLS: dict[str, dict[str, KernelImpl]] = {op: {} for op in OPS}


def register(
    op: str, backend: str, fn: Callable, available: Predicate = always_available, priority: int = 0
) -> None:
    """Register ``fn`` as ``backend``'s implementation of ``op``.

    ``available(device, dtype)`` says whether it can run there; among available backends the highest
    ``priority`` wins (``reference`` registers with priority 0). Registering the same (op, backend)
    twice with a different function is an error.
    """
    if op not in _IMPLS:
        raise ValueError(f"register: unknown op {op!r}; expected one of {list(OPS)}")
    if backend not in BACKEND_MODULES:
        raise ValueError(f"register: unknown backend {backend!r}; expected one of {list(BACKEND_MODULES)}")
    if not callable(fn):
        raise ValueError(f"register: fn for {op!r}/{backend!r} must be callable, got {type(fn).__name__}")
    existing = _IMPLS[op].get(backend)
    if existing is not None and existing.fn is not fn:
        raise ValueError(f"register: op {op!r} already has a {backend!r} implementation ({existing.fn!r})")
    _IMPLS[op][backend] = KernelImpl(op, backend, fn, available, int(priority))


@functools.cache
def load_backend(backend: str) -> str | None:
    """Import ``backend``'s module once. Returns None on success, else why it is unavailable."""
    if backend not in BACKEND_MODULES:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {list(BACKEND_MODULES)}")
    module = BACKEND_MODULES[backend]
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a backend probing a device it does not find
        reason = f"importing {module} failed: {type(exc).__name__}: {exc}"
        logger.debug("kernel backend %r unavailable: %s", backend, reason)
        return reason
    return None


def _load_all() -> None:
    for name in BACKEND_MODULES:
        load_backend(name)


def implementations(op: str) -> dict[str, KernelImpl]:
    """All registered implementations of ``op`` (after trying to import every backend module)."""
    if op not in _IMPLS:
        raise ValueError(f"unknown op {op!r}; expected one of {list(OPS)}")
    _load_all()
    return dict(_IMPLS[op])


def available_backends(op: str, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Backends that can run ``op`` on (device, dtype), best (highest priority) first."""
    impls = [i for i in implementations(op).values() if i.available(torch.device(device), dtype)]
    return [i.backend for i in sorted(impls, key=lambda i: -i.priority)]


def resolve(op: str, device: torch.device, dtype: torch.dtype, backend: str | None = None) -> KernelImpl:
    """The implementation of ``op`` to use on (device, dtype); ``backend`` forces one."""
    device = torch.device(device)
    if backend is None:
        names = available_backends(op, device, dtype)
        if not names:
            raise KernelBackendError(f"op {op!r}: no backend available for device={device}, dtype={dtype}")
        return _IMPLS[op][names[0]]
    reason = load_backend(backend)
    if reason is not None:
        raise KernelBackendError(f"op {op!r}: forced backend {backend!r} is unavailable ({reason})")
    impl = _IMPLS[op].get(backend)
    if impl is None:
        have = sorted(implementations(op))
        raise KernelBackendError(f"op {op!r} has no {backend!r} implementation (it has {have})")
    if not impl.available(device, dtype):
        raise KernelBackendError(
            f"op {op!r}: forced backend {backend!r} is not available for device={device}, dtype={dtype}"
        )
    return impl
