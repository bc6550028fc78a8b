"""Shared input validation for every op and every backend.

A :class:`Checker` validates the tensors of one call against symbolic shapes: the first tensor that
mentions a dimension name binds it, later ones must agree. Failures raise ``ValueError`` naming the op,
the argument and the expected shape with the bound sizes, e.g.
``rms_norm: weight must have shape [H=64], got (32,)``.

Checks here look only at metadata (shape, dtype, device), never at values, so they cost no device
synchronisation and are safe under CUDA graph capture. Value checks (index ranges) are the
``check_*_values`` helpers below; they read the data only when :func:`values_checkable` allows it. The
reference backend calls them on every call; the triton backends only for CPU tensors (Triton's
interpreter), since on a GPU they would synchronise the device on every call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn,)
ELLIPSIS = "..."


def _fmt_dtypes(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


class Checker:
    """Validates the arguments of one call of ``op``."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.dims: dict[str, int] = {}
        self.device: torch.device | None = None
        self.device_arg: str | None = None

    def fail(self, message: str) -> None:
        raise ValueError(f"{self.op}: {message}")

    def _expected(self, shape: Sequence[str | int]) -> str:
        parts = []
        for d in shape:
            if isinstance(d, int):
                parts.append(str(d))
            elif d == ELLIPSIS:
                parts.append("...")
            elif d in self.dims:
                parts.append(f"{d}={self.dims[d]}")
            else:
                parts.append(d)
        return "[" + ", ".join(parts) + "]"

    def tensor(
        self,
        name: str,
        t: object,
        shape: Sequence[str | int],
        dtypes: Sequence[torch.dtype] | None = None,
        same_device: bool = True,
    ) -> torch.Tensor:
        """Check ``t`` is a tensor of ``shape`` (names bind sizes; a leading ``"..."`` matches any
        leading dims), with a dtype in ``dtypes``, on the same device as the earlier tensors."""
        if not isinstance(t, torch.Tensor):
            self.fail(
                f"{name} must be a torch.Tensor of shape {self._expected(shape)}, got {type(t).__name__}"
            )
        assert isinstance(t, torch.Tensor)
        actual = t.shape
        spec = shape
        if spec and spec[0] == ELLIPSIS:
            spec = spec[1:]
            if len(actual) < len(spec):
                self.fail(f"{name} must have shape {self._expected(shape)}, got {tuple(actual)}")
            tail = actual[len(actual) - len(spec) :]
        elif len(actual) != len(spec):
            self.fail(f"{name} must have shape {self._expected(shape)}, got {tuple(actual)}")
        else:
            tail = actual
        dims = self.dims
        bound: list[str] = []  # names this tensor binds (unbound again if a later dimension disagrees)
        for d, n in zip(spec, tail):
            if isinstance(d, str):
                want = dims.get(d)
                if want is None:
                    dims[d] = n
                    bound.append(d)
                    continue
            elif isinstance(d, int):
                want = d
            else:  # a traced size (a SymInt of another tensor's shape under torch.compile): not compared
                continue
            if n != want:
                for name_ in bound:
                    del dims[name_]
                self.fail(f"{name} must have shape {self._expected(shape)}, got {tuple(actual)}")
        if dtypes is not None and t.dtype not in dtypes:
            self.fail(f"{name} must have dtype {_fmt_dtypes(dtypes)}, got {t.dtype}")
        if same_device:
            device = t.device
            if self.device is None:
                self.device, self.device_arg = device, name
            elif device != self.device:
                self.fail(f"{name} is on {device}, expected {self.device} (the device of {self.device_arg})")
        return t

    def optional(
        self,
        name: str,
        t: object,
        shape: Sequence[str | int],
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> torch.Tensor | None:
        if t is None:
            return None
        return self.tensor(name, t, shape, dtypes)

    def dim(self, name: str) -> int:
        return self.dims[name]

    def require(self, condition: bool, message: str) -> None:
        if not condition:
            self.fail(message)

    def positive_int(self, name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.fail(f"{name} must be a positive int, got {value!r}")
        return int(value)  # type: ignore[arg-type]

    def positive_float(self, name: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            self.fail(f"{name} must be a positive number, got {value!r}")
        return float(value)  # type: ignore[arg-type]

    def activation(self, value: object) -> str | None:
        if value not in (None, "silu", "swish"):
            self.fail(f"activation must be 'silu', 'swish' or None, got {value!r}")
        return value  # type: ignore[return-value]


def values_checkable(*tensors: torch.Tensor) -> bool:
    """Whether value checks (which synchronise the device) are allowed now: not while capturing a
    CUDA graph."""
    return not any(t.is_cuda for t in tensors) or not torch.cuda.is_current_stream_capturing()


def check_slot_values(op: str, name: str, slots: torch.Tensor, num_slots: int) -> None:
    """State-pool slots must be ``< S`` (entries < 0 mark padding and are allowed)."""
    if values_checkable(slots) and slots.numel() > 0:
        hi = int(slots.max())
        if hi >= num_slots:
            raise ValueError(f"{op}: {name} must be < S={num_slots} (or < 0 to skip), got {hi}")


def check_cu_seqlens_values(op: str, cu_seqlens: torch.Tensor, total: int) -> None:
    """``cu_seqlens[N+1]`` must start at 0, never decrease and end at ``T`` (every token belongs to
    exactly one sequence)."""
    if not values_checkable(cu_seqlens) or cu_seqlens.numel() == 0:
        return
    offsets = cu_seqlens.long()
    lens = offsets[1:] - offsets[:-1]
    bad_lens = lens.numel() > 0 and int(lens.min()) < 0
    if bad_lens or int(offsets[0]) != 0 or int(offsets[-1]) != total:
        raise ValueError(f"{op}: cu_seqlens must rise from 0 to T={total}, got {cu_seqlens.tolist()}")


def check_num_accepted_values(
    op: str,
    num_accepted: torch.Tensor | None,
    limit: int,
    limit_text: str,
    low: int = 1,
    name: str = "num_accepted",
) -> None:
    """A per-sequence count (None: all ones) must lie in ``[low, limit]``; ``limit_text`` names the bound,
    ``name`` the argument (``num_accepted`` of the conv op, ``num_commit`` of the verify op)."""
    if num_accepted is None or num_accepted.numel() == 0 or not values_checkable(num_accepted):
        return
    lo, hi = int(num_accepted.min()), int(num_accepted.max())
    if lo < low or hi > limit:
        raise ValueError(f"{op}: {name} must lie in [{low}, {limit_text}], got values in [{lo}, {hi}]")
