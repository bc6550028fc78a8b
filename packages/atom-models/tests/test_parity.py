"""Float32 CPU parity of the target and MTP draft against transformers and the golden outputs."""

from __future__ import annotations

import pytest
import torch
from atom_core import Qwen3NextConfig, testing
from atom_models import DenseContext, DenseCoreFactory, Qwen3NextForCausalLM, load_target

transformers = testing.import_oracle("transformers", "transformers (the float32 reference)")

# (comparison, dtype) -> atol on logits. Measured max abs error in the comment (float32, CPU, reference kernels).
TOLERANCES = {
    ("target_vs_transformers", torch.float32): 1e-4,  # measured 1.0e-5 (dense cores on paged_attention)
    ("target_vs_golden", torch.float32): 1e-4,  # measured 4.8e-5 (golden = transformers, make_reference.py)
    ("mtp_vs_golden", torch.float32): 1e-4,  # measured 2.5e-5
    ("random_config_vs_transformers", torch.float32): 1e-4,  # measured 1.4e-5
}


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    err = _max_err(ours, ref)
    tol = TOLERANCES[(name, torch.float32)]
    print(f"{name}: max abs error {err:.3e} (atol {tol:.0e})")
    assert err <= tol, f"{name}: max abs error {err:.3e} > atol {tol:.0e}"


@pytest.fixture(scope="module")
def our_target_logits(dense_models, golden):
    """Teacher-forced logits of the three golden rows, run as ONE varlen batch (DenseContext)."""
    target, _ = dense_models
    ids = golden["input_ids"]
    b, t = ids.shape
    with torch.no_grad():
        hidden = target(ids.reshape(-1), torch.arange(t).repeat(b), DenseContext((t,) * b))
        logits = target.compute_logits(hidden)
    return hidden.view(b, t, -1), logits.view(b, t, -1)


def test_target_matches_transformers(model_dir, golden, our_target_logits):
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(golden["input_ids"]).logits
    _check("target_vs_transformers", our_target_logits[1], ref)


def test_target_matches_golden(golden, our_target_logits):
    _check("target_vs_golden", our_target_logits[1], golden["target_logits"])


def test_mtp_matches_golden(dense_models, golden, our_target_logits):
    _, mtp = dense_models
    hidden, _ = our_target_logits
    ids = golden["input_ids"]
    b, t = ids.shape
    with torch.no_grad():
        h = mtp(
            ids[:, 1:].reshape(-1),
            torch.arange(t - 1).repeat(b),
            hidden[:, :-1].reshape(-1, hidden.shape[-1]),
            DenseContext((t - 1,) * b),
        )
        logits = mtp.compute_logits(h).view(b, t - 1, -1)
    _check("mtp_vs_golden", logits, golden["mtp_logits"])


def test_mtp_shares_embedding_and_head(dense_models):
    target, mtp = dense_models
    assert mtp.embed_tokens is target.model.embed_tokens
    assert mtp.lm_head is target.lm_head
    assert mtp.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert list(mtp.layers.keys()) == [str(target.config.num_hidden_layers)]


RANDOM_LAYER_TYPES = [
    "linear_attention",
    "full_attention",
    "linear_attention",
    "linear_attention",
    "full_attention",
    "linear_attention",
]


def _random_hf_checkpoint(path) -> None:
    """A random-weight Qwen3-Next with other shapes than the fixture, saved by transformers itself."""
    cfg = transformers.Qwen3NextConfig(
        vocab_size=512,
        hidden_size=96,
        num_hidden_layers=6,
        layer_types=RANDOM_LAYER_TYPES,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        attention_bias=True,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=32,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=3,
        intermediate_size=80,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        decoder_sparse_step=2,  # MoE in layers 1, 3, 5 ...
        mlp_only_layers=[3],  # ... but not 3: dense MLP in 0, 2, 3, 4
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        max_position_embeddings=256,
        initializer_range=0.08,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(cfg).float()
    with torch.no_grad():  # zero-initialised norms would hide a wrong (1 + w) convention
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model.eval()


def test_random_config_matches_transformers(tmp_path, kernels32):
    hf = _random_hf_checkpoint(tmp_path)
    cfg = Qwen3NextConfig.from_hf(tmp_path)
    assert cfg.layer_types == tuple(RANDOM_LAYER_TYPES)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    ours = Qwen3NextForCausalLM(cfg, DenseCoreFactory(kernels32), kernels32)
    load_target(ours, tmp_path)
    torch.manual_seed(1)
    lens = (37, 70)  # 70 > one 64-token GDN chunk
    ids = [torch.randint(0, 512, (n,)) for n in lens]
    with torch.no_grad():
        ref = torch.cat([hf(x[None]).logits[0] for x in ids])
        pos = torch.cat([torch.arange(n) for n in lens])
        logits = ours.compute_logits(ours(torch.cat(ids), pos, DenseContext(lens)))
    _check("random_config_vs_transformers", logits, ref)


def test_dense_attention_goes_through_atom_kernels(model_dir, kernels32):
    """The dense attention core has no attention math of its own: it calls kernels.kv_cache_write and
    kernels.paged_attention (a scratch cache per call), and matches a plain causal softmax per sequence."""
    import dataclasses

    from atom_models.dense_cores import DenseAttentionCore

    calls = []

    def spy(name):
        fn = getattr(kernels32, name)
        return lambda *a, **kw: calls.append(name) or fn(*a, **kw)

    kern = dataclasses.replace(
        kernels32, kv_cache_write=spy("kv_cache_write"), paged_attention=spy("paged_attention")
    )
    cfg = Qwen3NextConfig.from_hf(model_dir)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    core = DenseAttentionCore(cfg, kern, block_size=4)
    lens = (5, 1, 9)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), h, d, generator=g) for h in (hq, hkv, hkv))
    out = core(q, k, v, DenseContext(lens))
    assert calls == ["kv_cache_write", "paged_attention"]
    start = 0
    for n in lens:
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(hq // hkv, 0), vs.repeat_interleave(hq // hkv, 0)
        w = (qs @ ks.transpose(1, 2)) * d**-0.5
        w = w.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        err = (out[start : start + n] - (w @ vs).transpose(0, 1)).abs().max().item()
        assert err < 1e-5, f"sequence of {n}: max abs error {err:.2e}"
        start += n
