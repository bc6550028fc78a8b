"""Detect host synchronisation in code meant to be captured in a CUDA graph, on any device (CPU included).

``torch.cuda.set_sync_debug_mode("error")`` catches a device-to-host sync only on a GPU. :class:`HostSyncGuard`
catches, on CPU as well, what would be one there or what cannot be captured:

- a device value read by the host: ``aten._local_scalar_dense`` (``int(t)``, ``float(t)``, ``bool(t)``, the
  scalar read of ``Tensor.item``) and ``Tensor.tolist``;
- data-dependent shapes: ``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing, and
  ``repeat_interleave`` without ``output_size``;
- a tensor built from Python data (``torch.tensor(list)``, seen as ``aten.lift_fresh``).

Kernels may be exempted (a reference op may read values on the CPU; its GPU backend must not): wrap them
with :meth:`HostSyncGuard.exempt_kernels`. A violation raises :class:`HostSyncError` naming the op.
``Tensor.tolist`` is not an aten op, so the guard replaces it on ``torch.Tensor`` while it is entered.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_FORBIDDEN = {
    _aten._local_scalar_dense: "reads a device value on the host",
    _aten.nonzero: "has a data-dependent shape",
    _aten.masked_select: "has a data-dependent shape",
    _aten._unique2: "has a data-dependent shape",
    _aten.unique_dim: "has a data-dependent shape",
    _aten.unique_consecutive: "has a data-dependent shape",
    _aten.lift_fresh: "builds a tensor from Python data",
}
_INDEXING = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}


class HostSyncError(RuntimeError):
    """An op that synchronises with the host (or cannot be captured) ran inside a :class:`HostSyncGuard`."""


class HostSyncGuard(TorchDispatchMode):
    """``with HostSyncGuard(): forward(...)`` raises :class:`HostSyncError` at the first host sync."""

    def __init__(self) -> None:
        super().__init__()
        self._exempt = 0
        self._saved_tolist: Callable | None = None

    def __enter__(self):
        self._saved_tolist = torch.Tensor.tolist
        guard, real = self, self._saved_tolist

        def tolist(t: torch.Tensor):
            if not guard._exempt:
                raise HostSyncError("Tensor.tolist reads device values on the host")
            return real(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._saved_tolist
        return super().__exit__(*exc)

    @contextmanager
    def exempt(self):
        """Inside: nothing is checked (a kernel's own host-side validation)."""
        self._exempt += 1
        try:
            yield
        finally:
            self._exempt -= 1

    def exempt_kernels(self, kernels):
        """A copy of an ``atom_kernels.Kernels`` whose every op runs exempt from the check."""

        def wrap(fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                with self.exempt():
                    return fn(*args, **kwargs)

            return call

        ops = {
            f.name: wrap(getattr(kernels, f.name))
            for f in dataclasses.fields(kernels)
            if f.name not in ("device", "dtype", "backends")
        }
        return dataclasses.replace(kernels, **ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._exempt:
            packet = func.overloadpacket
            why = _FORBIDDEN.get(packet)
            if why is None and packet in _INDEXING:
                indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                if any(i is not None and i.dtype == torch.bool for i in indices):
                    why = "indexes with a boolean mask (data-dependent shape)"
            repeats = args[0] if len(args) == 1 else (args[1] if len(args) > 1 else None)
            if (
                why is None
                and packet is _aten.repeat_interleave
                and kwargs.get("output_size") is None
                and isinstance(repeats, torch.Tensor)
            ):
                why = "has a data-dependent shape without output_size"
            if why is not None:
                raise HostSyncError(f"{func} {why}")
        return func(*args, **kwargs)
