"""The backend registry: fallback, forced selection (argument and env), errors, lazy import logging."""

from __future__ import annotations

import inspect
import logging
from types import MappingProxyType

import atom_kernels
import pytest
import torch
from atom_core.errors import ConfigError
from atom_kernels import registry
from atom_kernels.backends.reference import REFERENCE_OPS
from atom_kernels.kernels import Kernels, select_kernels


def test_reference_covers_every_op():
    kern = select_kernels("cpu", torch.float32, backend="reference")
    assert isinstance(kern, Kernels)
    for op in registry.OPS:
        assert kern.backend_of(op) == "reference"
        assert getattr(kern, op) is registry.implementations(op)["reference"].fn
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        kern.backend_of("nope")
    with pytest.raises(AttributeError):
        kern.rms_norm = None  # frozen


def test_default_on_cpu_is_the_cpu_backend():
    from atom_kernels.backends.cpu import CPU_OPS
    from atom_kernels.backends.reference import REFERENCE_OPS

    kern = atom_kernels.select_kernels(torch.device("cpu"), torch.bfloat16, environ={})
    assert {kern.backend_of(op) for op in registry.OPS} == {"cpu"}
    for op in registry.OPS:  # the reference's own function where the backend has no form of its own
        assert (getattr(kern, op) is REFERENCE_OPS[op]) == (op not in CPU_OPS), op
    assert registry.available_backends("gated_delta_rule_verify", torch.device("meta"), torch.float32) == [
        "reference"
    ]


def test_missing_backend_module_is_unavailable_and_logged_once(monkeypatch, caplog):
    modules = {**registry.BACKEND_MODULES, "missing": "atom_kernels._no_such_backend_module"}
    monkeypatch.setattr(registry, "BACKEND_MODULES", MappingProxyType(modules))
    registry.load_backend.cache_clear()
    try:
        with caplog.at_level(logging.DEBUG, logger="atom_kernels.registry"):
            for _ in range(3):
                kern = select_kernels("cpu", torch.float32, environ={})
        assert kern.backend_of("rms_norm") == "cpu"
        records = [r for r in caplog.records if "'missing' unavailable" in r.getMessage()]
        assert len(records) == 1 and records[0].levelno == logging.DEBUG
        with pytest.raises(
            registry.KernelBackendError, match="op 'rms_norm': forced backend 'missing' is unavailable"
        ):
            select_kernels("cpu", torch.float32, backend="missing")
    finally:
        registry.load_backend.cache_clear()


@pytest.fixture
def fake_triton(monkeypatch):
    """A private registry (reference only, whatever backends this machine has) plus a 'triton' rms_norm available on CPU for float32 only."""
    only_reference = {op: {"reference": impls["reference"]} for op, impls in registry._IMPLS.items()}
    monkeypatch.setattr(registry, "_IMPLS", only_reference)
    monkeypatch.setattr(registry, "load_backend", lambda name: None)

    def fast_rms_norm(x, weight, eps, residual=None):
        raise AssertionError("not called")

    registry.register(
        "rms_norm", "triton", fast_rms_norm, available=lambda dev, dt: dt == torch.float32, priority=10
    )
    return fast_rms_norm


def test_priority_and_availability(fake_triton):
    kern = select_kernels("cpu", torch.float32, environ={})
    assert kern.backend_of("rms_norm") == "triton" and kern.rms_norm is fake_triton
    assert kern.backend_of("rope") == "reference"
    kern_bf16 = select_kernels("cpu", torch.bfloat16, environ={})
    assert kern_bf16.backend_of("rms_norm") == "reference"
    forced_ref = select_kernels(
        "cpu", torch.float32, backend="reference", environ={"ATOM_KERNEL_BACKEND": "triton"}
    )
    assert forced_ref.backend_of("rms_norm") == "reference", "the argument overrides the env switch"


def test_forcing_a_backend_an_op_lacks_names_the_op(fake_triton):
    with pytest.raises(
        registry.KernelBackendError, match="op 'gated_rms_norm' has no 'triton' implementation"
    ):
        select_kernels("cpu", torch.float32, backend="triton")
    with pytest.raises(registry.KernelBackendError, match="op 'gated_rms_norm' has no 'triton'"):
        select_kernels("cpu", torch.float32, environ={"ATOM_KERNEL_BACKEND": "triton"})
    with pytest.raises(
        registry.KernelBackendError, match="'triton' is not available for device=cpu, dtype=torch.bfloat16"
    ):
        registry.resolve("rms_norm", torch.device("cpu"), torch.bfloat16, "triton")


def test_env_switch(monkeypatch):
    monkeypatch.setenv("ATOM_KERNEL_BACKEND", "reference")
    assert select_kernels("cpu", torch.float32).backend_of("moe_experts") == "reference"
    monkeypatch.setenv("ATOM_KERNEL_BACKEND", "cuda-magic")
    with pytest.raises(ConfigError, match="ATOM_KERNEL_BACKEND"):
        select_kernels("cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        select_kernels("cpu", torch.float32, backend="fast")


def test_register_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown op 'rmsnorm'"):
        registry.register("rmsnorm", "triton", lambda: None)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        registry.register("rms_norm", "cuda", lambda: None)
    with pytest.raises(ValueError, match="already has a 'reference' implementation"):
        registry.register("rms_norm", "reference", lambda: None)


def test_backend_modules_table_is_read_only():
    with pytest.raises(TypeError):
        registry.BACKEND_MODULES["triton"] = "somewhere.else"  # type: ignore[index]


def _spec(op: str) -> list[inspect.Parameter]:
    """The reference implementation's parameters: the one written source of ``op``'s signature."""
    return list(inspect.signature(REFERENCE_OPS[op]).parameters.values())


@pytest.mark.parametrize("op", registry.OPS)
def test_every_backend_has_the_reference_signature(op):
    """Every importable backend takes the reference's parameters (names, kinds, defaults, in order); extra
    ones only keyword-only, with defaults."""
    spec = [(p.name, p.kind, p.default) for p in _spec(op)]
    for backend, impl in registry.implementations(op).items():
        params = list(inspect.signature(impl.fn).parameters.values())
        head = [(p.name, p.kind, p.default) for p in params[: len(spec)]]
        assert head == spec, f"{op}: {backend}'s {impl.fn.__qualname__} differs from the reference"
        for extra in params[len(spec) :]:
            assert (
                extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not inspect.Parameter.empty
            ), f"{op}: {backend}'s extra parameter {extra.name!r} must be keyword-only with a default"


@pytest.mark.parametrize("op", registry.OPS)
def test_every_check_takes_the_reference_parameters(op):
    """``check_<op>`` (which every backend's op calls) takes the reference's parameters by name, in order;
    extra ones (a backend's wider contract) only keyword-only, with defaults."""
    reference = REFERENCE_OPS[op]
    check = getattr(inspect.getmodule(reference), f"check_{op}")
    names = [p.name for p in _spec(op)]
    params = list(inspect.signature(check).parameters.values())
    assert [p.name for p in params[: len(names)]] == names
    for extra in params[len(names) :]:
        assert (
            extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not inspect.Parameter.empty
        ), f"check_{op}'s extra parameter {extra.name!r} must be keyword-only with a default"


def test_slow_fallback_warning_names_the_missing_dependency():
    """A bf16 GPU whose chunked GDN prefill resolved to the reference (fla-core missing) gets one warning
    naming the op and the install; a CPU, float32 (reference by design) or a fast backend gets none."""
    from atom_kernels.kernels import slow_fallbacks

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    ref = {"gated_delta_rule_chunked": "reference"}
    (msg,) = slow_fallbacks(cuda, torch.bfloat16, ref)
    assert "gated_delta_rule_chunked" in msg and "fla-core" in msg and "atom-kernels[fla]" in msg
    assert slow_fallbacks(cuda, torch.bfloat16, {"gated_delta_rule_chunked": "triton"}) == []
    assert slow_fallbacks(cuda, torch.float32, ref) == []
    assert slow_fallbacks(cpu, torch.bfloat16, ref) == []
