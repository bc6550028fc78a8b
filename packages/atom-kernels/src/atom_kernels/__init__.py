"""atom-kernels: every numeric op Qwen3-Next and its MTP head need, behind a backend registry.

``select_kernels(device, dtype)`` returns a frozen :class:`Kernels` with one resolved callable per op;
see docs/kernel-api.md for the contract and README.md for backends and forcing.
"""

from atom_kernels import backends as _backends  # noqa: F401
from atom_kernels.backends import reference as _reference  # noqa: F401  (registers the reference ops)
from atom_kernels.kernels import Kernels, select_kernels
from atom_kernels.registry import OPS, KernelBackendError, register

__all__ = ["OPS", "KernelBackendError", "Kernels", "register", "select_kernels"]
