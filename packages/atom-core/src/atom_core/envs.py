"""Every ATOM environment switch, documented in one place.

Values are read when asked for (not at import), and parsed strictly: an unknown or malformed value
raises :class:`~atom_core.errors.ConfigError` naming the variable, never falls back to a default.

| variable | values | default | effect |
|---|---|---|---|
| ``ATOM_DISABLE_VLLM_PLUGIN`` | ``0``/``1`` | ``0`` | ``1``: the vLLM plugin registers nothing; stock vLLM models run. |
| ``ATOM_KERNEL_BACKEND`` | ``reference``/``cpu``/``triton`` | unset | force one kernel backend for every op (debugging); an op without that backend raises. |
| ``ATOM_KERNELS_PDL`` | ``0``/``1`` | ``1`` | ``0``: the Triton kernels launch without programmatic dependent launch (Hopper and later; elsewhere it is never used). |
| ``ATOM_DATA_ROOT`` | a directory | unset | the repository checkout whose ``data/`` holds the bundled model and its reference outputs (default: found from the current directory or the installed package, :mod:`atom_core.paths`). |
| ``ATOM_REQUIRE_ORACLES`` | ``0``/``1`` | ``0`` | tests: ``1`` makes a test whose oracle (reference files, transformers, vLLM) is missing fail instead of skip (:mod:`atom_core.testing`; ``scripts/test.sh`` and ``scripts/ci_packages.sh`` set it). |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from atom_core.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class EnvSwitch:
    name: str
    doc: str


ATOM_DISABLE_VLLM_PLUGIN = EnvSwitch(
    "ATOM_DISABLE_VLLM_PLUGIN", "1 disables the vLLM plugin (stock vLLM runs)"
)
ATOM_KERNEL_BACKEND = EnvSwitch("ATOM_KERNEL_BACKEND", "force one kernel backend for every op")
ATOM_KERNELS_PDL = EnvSwitch(
    "ATOM_KERNELS_PDL", "0 launches the Triton kernels without programmatic dependent launch"
)
ATOM_DATA_ROOT = EnvSwitch("ATOM_DATA_ROOT", "the repository checkout whose data/ holds the fixtures")
ATOM_REQUIRE_ORACLES = EnvSwitch(
    "ATOM_REQUIRE_ORACLES", "1 fails tests whose oracle is missing instead of skipping them"
)
KERNEL_BACKENDS = ("reference", "cpu", "triton")


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def get_bool(switch: EnvSwitch, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    raw = _env(environ).get(switch.name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(switch.name, raw, "env", f"expected one of {list(_TRUE + _FALSE[:-1])}")


def plugin_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``ATOM_DISABLE_VLLM_PLUGIN``: whether the vLLM plugin must stay out of the way."""
    return get_bool(ATOM_DISABLE_VLLM_PLUGIN, False, environ)


def forced_kernel_backend(environ: Mapping[str, str] | None = None) -> str | None:
    """``ATOM_KERNEL_BACKEND``: the backend name forced for every op, or None."""
    raw = _env(environ).get(ATOM_KERNEL_BACKEND.name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value not in KERNEL_BACKENDS:
        raise ConfigError(ATOM_KERNEL_BACKEND.name, raw, "env", f"expected one of {list(KERNEL_BACKENDS)}")
    return value


def pdl_requested(environ: Mapping[str, str] | None = None) -> bool:
    """``ATOM_KERNELS_PDL``: whether the Triton kernels may use programmatic dependent launch (default on)."""
    return get_bool(ATOM_KERNELS_PDL, True, environ)


def data_root(environ: Mapping[str, str] | None = None) -> Path | None:
    """``ATOM_DATA_ROOT``: the checkout holding ``data/``, or None (unset or empty); it must be a directory."""
    raw = _env(environ).get(ATOM_DATA_ROOT.name)
    if raw is None or raw.strip() == "":
        return None
    path = Path(raw.strip()).expanduser()
    if not path.is_dir():
        raise ConfigError(ATOM_DATA_ROOT.name, raw, "env", "not a directory")
    return path


def oracles_required(environ: Mapping[str, str] | None = None) -> bool:
    """``ATOM_REQUIRE_ORACLES``: whether a test must fail, not skip, when its oracle is missing."""
    return get_bool(ATOM_REQUIRE_ORACLES, False, environ)
