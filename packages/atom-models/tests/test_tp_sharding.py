"""Tensor-parallel sharding without communication (building and loading a rank needs none): per-rank
parameter bytes and state sizes, the loader reading only its slices, errors at TP = 2, non-divisible TP,
FP8 slices equal to TP = 1's and the FP8 block rule."""

from __future__ import annotations

import importlib.util
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from atom_core import ConfigError, Qwen3NextConfig
from atom_models import (
    CheckpointError,
    DenseCoreFactory,
    Qwen3NextForCausalLM,
    Qwen3NextMTP,
    load_mtp,
    load_target,
)
from atom_models import loader as loader_mod
from atom_models.gdn_state import GDNGeometry
from atom_models.moe import Fp8Experts, SparseMoeBlock
from atom_models.parallel import RankWithoutGroup, TPLayout
from atom_models.parallel.shard import ROW, LinearShard, check_fp8_shard
from atom_models.weight_map import map_name
from safetensors.torch import load_file, save_file

TP = 2
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_fp8_checkpoint.py"
# Parameters every rank holds whole (by name pattern), and why: norms act per channel of the replicated
# hidden state (or per channel of one GDN / attention head); the router and shared_expert_gate see the
# whole hidden state and every rank routes every token; the MTP fc is replicated (see Qwen3NextMTP).
REPLICATED = (
    r"(^|\.)norm\.weight$",
    r"layernorm\.weight$",
    r"\.[qk]_norm\.weight$",
    r"pre_fc_norm_(embedding|hidden)\.weight$",
    r"\.mlp\.gate\.weight$",
    r"\.shared_expert_gate\.weight$",
    r"^fc\.weight$",
)


def _models(ckpt, kernels, parallel=None, load=False):
    cfg = Qwen3NextConfig.from_hf(ckpt)
    kw = {} if parallel is None else {"parallel": parallel}
    cores = DenseCoreFactory(kernels)
    target = Qwen3NextForCausalLM(cfg, cores, kernels, **kw)
    if load:
        load_target(target, ckpt)
    mtp = Qwen3NextMTP(cfg, cores, kernels, target.model.embed_tokens, target.lm_head, **kw)
    if load:
        load_mtp(mtp, ckpt)
    return target, mtp


def _params(target, mtp) -> dict[str, torch.Tensor]:
    out = {n: p for n, p in target.named_parameters()}
    out.update(
        {
            f"mtp.{n}": p
            for n, p in mtp.named_parameters()
            if n.split(".")[0] not in ("embed_tokens", "lm_head")
        }
    )
    return out


def _replicated(name: str) -> bool:
    local = name.removeprefix("mtp.")
    return any(re.search(p, local) for p in REPLICATED)


def _group(name: str) -> str:
    return re.sub(r"layers\.\d+\.", "layers.*.", name)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _table(title: str, full: dict[str, torch.Tensor], ranks: list[dict[str, torch.Tensor]]) -> None:
    rows: dict[str, list[int]] = defaultdict(lambda: [0] * (1 + len(ranks)))
    for n, p in full.items():
        rows[_group(n)][0] += _bytes(p)
        for r, params in enumerate(ranks):
            rows[_group(n)][1 + r] += _bytes(params[n])
    print(f"\n{title}: bytes per rank (TP=1 | TP={len(ranks)} rank 0 .. {len(ranks) - 1})")
    for g, b in sorted(rows.items()):
        kind = "replicated" if b[1] == b[0] else f"1/{round(b[0] / b[1])}"
        print(f"  {g:60s} {b[0]:>10,d} | " + " ".join(f"{x:>10,d}" for x in b[1:]) + f"  {kind}")
    tot = [sum(b[i] for b in rows.values()) for i in range(1 + len(ranks))]
    print(f"  {'TOTAL':60s} {tot[0]:>10,d} | " + " ".join(f"{x:>10,d}" for x in tot[1:]))


def test_per_rank_parameter_bytes(model_dir, kernels32):
    full = _params(*_models(model_dir, kernels32))
    ranks = [_params(*_models(model_dir, kernels32, RankWithoutGroup(r, TP))) for r in range(TP)]
    _table("float32 target + MTP", full, ranks)
    replicated = sorted({_group(n) for n in full if _replicated(n)})
    print("  replicated:", ", ".join(replicated))
    for params in ranks:
        assert params.keys() == full.keys()
        for n, p in full.items():
            local = params[n].numel()
            if _replicated(n):
                assert local == p.numel(), f"{n}: replicated, but rank holds {local} of {p.numel()} elements"
            else:
                assert local * TP == p.numel(), f"{n}: rank holds {local} of {p.numel()} elements, not 1/{TP}"
    total = sum(_bytes(p) for p in full.values())
    per_rank = sum(_bytes(p) for p in ranks[0].values())
    assert per_rank < 0.51 * total + sum(_bytes(p) for n, p in full.items() if _replicated(n))


def test_per_rank_state_and_heads(model_dir, kernels32):
    cfg = Qwen3NextConfig.from_hf(model_dir)
    print("\nper-rank state (k=1):")
    for r in range(TP):
        layout = TPLayout.from_config(cfg, r, TP)
        one, mine = GDNGeometry.from_config(cfg, 1), GDNGeometry.from_config(cfg, 1, layout)
        for what in ("conv_shape", "ssm_shape", "pending_shape"):
            a, b = getattr(one, what), getattr(mine, what)
            print(f"  rank {r} GDN {what}: TP=1 {a} -> TP={TP} {b}")
            assert torch.Size(a).numel() == TP * torch.Size(b).numel(), f"{what}: {b} is not 1/{TP} of {a}"
        assert layout.num_kv_heads * TP == cfg.num_key_value_heads and layout.kv_head_start == r
        print(
            f"  rank {r} attention: {layout.num_heads} query heads, KV head {layout.kv_head_start} (1 of {cfg.num_key_value_heads})"
        )
        target, _ = _models(model_dir, kernels32, RankWithoutGroup(r, TP))
        attn = target.model.layers[3].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (layout.num_heads, layout.num_kv_heads)
        assert target.model.layers[0].linear_attn.core.geometry == GDNGeometry.from_config(cfg, layout=layout)


class _SpySlice:
    def __init__(self, sl, name, log):
        self.sl, self.name, self.log = sl, name, log

    def get_shape(self):
        return self.sl.get_shape()

    def get_dtype(self):
        return self.sl.get_dtype()

    def __getitem__(self, idx):
        t = self.sl[idx]
        self.log.append(("slice", self.name, t.numel()))
        return t


class _SpyFile:
    def __init__(self, real, log):
        self.real, self.log = real, log

    def __enter__(self):
        self.f = self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.log.append(("full", name, t.numel()))
        return t

    def get_slice(self, name):
        return _SpySlice(self.f.get_slice(name), name, self.log)


def test_loader_reads_only_the_ranks_slices(model_dir, kernels32, monkeypatch):
    log: list[tuple[str, str, int]] = []
    real = loader_mod.safe_open
    monkeypatch.setattr(loader_mod, "safe_open", lambda *a, **k: _SpyFile(real(*a, **k), log))
    target, mtp = _models(model_dir, kernels32, RankWithoutGroup(1, TP), load=True)
    ckpt_numel = sum(
        t.numel() for f in sorted(Path(model_dir).glob("*.safetensors")) for t in load_file(str(f)).values()
    )
    read = sum(n for _, _, n in log)
    held = sum(p.numel() for p in _params(target, mtp).values())
    # a folded router repeats the shared gate row up to an 8-row multiple: those rows are written, not read
    held -= sum(
        (m.gate.weight.shape[0] - m.experts.num_experts - 1) * m.gate.weight.shape[1]
        for model in (target, mtp)
        for m in model.modules()
        if isinstance(m, SparseMoeBlock) and m.num_shared
    )
    print(f"\nrank 1 of {TP} read {read:,d} of {ckpt_numel:,d} checkpoint elements; it holds {held:,d}")
    for kind, name, _ in log:
        scope_name = name.removeprefix("model.").removeprefix("mtp.")
        t = map_name(scope_name)
        tp = "rows" if name == "lm_head.weight" else (t.tp if t is not None else None)
        if tp is not None:
            assert kind == "slice", f"{name} is sharded ({tp}) but was read whole"
    assert read == held, (
        f"read {read} elements for {held} parameter elements (a tensor read twice or too much)"
    )
    assert read < 0.6 * ckpt_numel


def test_mis_shaped_tensor_at_tp2_names_file_tensor_and_full_shape(model_dir, kernels32, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(model_dir, dst)
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    fname = "model-00001-of-00002.safetensors"
    tensors = load_file(str(dst / fname))
    assert name in tensors
    tensors[name] = tensors[name][:-2]
    save_file(tensors, str(dst / fname))
    cfg = Qwen3NextConfig.from_hf(dst)
    target = Qwen3NextForCausalLM(
        cfg, DenseCoreFactory(kernels32), kernels32, parallel=RankWithoutGroup(1, TP)
    )
    with pytest.raises(CheckpointError) as e:
        load_target(target, dst)
    msg = str(e.value)
    print(msg)
    assert name in msg and fname in msg and "[1534, 256]" in msg and "expected [1536, 256]" in msg
    assert "rank 1 of 2 holds [768, 256]" in msg


def test_non_divisible_tp_names_the_field(model_dir, kernels32):
    cfg = Qwen3NextConfig.from_hf(model_dir)
    for cls_args in ((cfg, DenseCoreFactory(kernels32), kernels32),):
        with pytest.raises(ConfigError) as e:
            Qwen3NextForCausalLM(*cls_args, parallel=RankWithoutGroup(0, 4))
        assert "linear_num_key_heads" in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        TPLayout.from_config(cfg, 0, 8)


def test_layout_of_another_rank_is_refused(model_dir, kernels32):
    from atom_models.moe import SparseMoeBlock

    cfg = Qwen3NextConfig.from_hf(model_dir)
    with pytest.raises(ValueError, match=r"rank 1 of 2 passed with a parallel context of rank 0 of 2"):
        SparseMoeBlock(
            cfg, kernels32, layout=TPLayout.from_config(cfg, 1, TP), parallel=RankWithoutGroup(0, TP)
        )
    assert TPLayout.of(cfg, RankWithoutGroup(1, TP)) == TPLayout.from_config(cfg, 1, TP)


def _fp8_dir(model_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("make_fp8_checkpoint", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dst = tmp_path / "tiny-fp8"
    mod.make_fp8_checkpoint(model_dir, dst)
    return dst


def test_fp8_rank_slices_equal_tp1_slices(model_dir, kernels32, tmp_path):
    """Each rank's FP8 weights and block scales are exactly the rows/columns of TP=1's that it should hold
    (e4m3 bytes compared), and its weights are 1/TP of TP=1's."""
    ckpt = _fp8_dir(model_dir, tmp_path)
    full = _params(*_models(ckpt, kernels32, load=True))
    ranks = [_params(*_models(ckpt, kernels32, RankWithoutGroup(r, TP), load=True)) for r in range(TP)]
    _table("FP8 target + MTP", full, ranks)
    fp8 = [n for n, p in full.items() if p.dtype == torch.float8_e4m3fn]
    assert len(fp8) > 20
    for n in fp8:
        assert ranks[0][n].numel() * TP == full[n].numel(), n
    # attention qkv_proj: q rows by query head, k / v rows by KV head (with their own block-scale rows);
    # experts: gate rows, up rows, down columns; shared expert down columns
    qkv = "model.layers.3.self_attn.qkv_proj.weight"
    w13, w2 = "model.layers.1.mlp.experts.w13", "model.layers.1.mlp.experts.w2"
    down = "model.layers.2.mlp.shared_expert.down_proj.weight"
    for r, p in enumerate(ranks):
        u8 = lambda t: t.view(torch.uint8)  # noqa: E731
        rows = [
            (r * 512, (r + 1) * 512),
            (1024 + r * 128, 1024 + (r + 1) * 128),
            (1280 + r * 128, 1280 + (r + 1) * 128),
        ]
        assert torch.equal(u8(p[qkv]), u8(torch.cat([full[qkv][s:e] for s, e in rows])))
        # TP=1's scale rows: [q 8 | k 2 | v 2] blocks of 128 rows
        scale_rows = [(r * 4, (r + 1) * 4), (8 + r, 9 + r), (10 + r, 11 + r)]
        assert torch.equal(
            p[qkv + "_scale_inv"], torch.cat([full[qkv + "_scale_inv"][s:e] for s, e in scale_rows])
        )
        i = full[w13].shape[1] // 2
        h = i // TP
        want = torch.cat([full[w13][:, r * h : (r + 1) * h], full[w13][:, i + r * h : i + (r + 1) * h]], 1)
        assert torch.equal(u8(p[w13]), u8(want))
        assert torch.equal(p[w13 + "_scale_inv"], full[w13 + "_scale_inv"])  # 32 of 64 rows: the same block
        assert torch.equal(u8(p[w2]), u8(full[w2][:, :, r * h : (r + 1) * h]))
        assert torch.equal(u8(p[down]), u8(full[down][:, r * 64 : (r + 1) * 64]))


def test_fp8_slice_straddling_a_block_is_refused():
    # rows [96, 192) of a 384-row weight with 128-row blocks: starts inside block 0, ends in block 1
    shard = LinearShard("column", RankWithoutGroup(1, 4), (384,), ((96, 192),))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj.*96 rows.*128-row block"):
        check_fp8_shard("layers.0.mlp.down_proj", shard, (128, 128))
    # rank 0's own rows [0, 96) lie inside block 0, but it refuses too: every rank reaches the same verdict
    # (a rank that built would wait in its first collective for the rank that raised)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj.*96 rows.*\[96, 192\)"):
        check_fp8_shard(
            "layers.0.mlp.down_proj",
            LinearShard("column", RankWithoutGroup(0, 4), (384,), ((0, 96),)),
            (128, 128),
        )
    check_fp8_shard("ok", LinearShard(ROW, RankWithoutGroup(1, 2), (256,), ((128, 256),)), (128, 128))
    check_fp8_shard("inside", LinearShard(ROW, RankWithoutGroup(1, 2), (64,), ((32, 64),)), (128, 128))
    # moe_intermediate_size 192 over 2 ranks: rank 1's rows [96, 192) straddle blocks 0 and 1
    with pytest.raises(ValueError, match=r"layers\.5\.mlp\.experts.*96 rows"):
        Fp8Experts(
            4,
            256,
            96,
            (128, 128),
            intermediate_range=(96, 192),
            full_intermediate_size=192,
            name="layers.5.mlp.experts",
        )
    with pytest.raises(ValueError, match=r"layers\.5\.mlp\.experts.*96 rows"):  # rank 0 as well
        Fp8Experts(
            4,
            256,
            96,
            (128, 128),
            intermediate_range=(0, 96),
            full_intermediate_size=192,
            name="layers.5.mlp.experts",
        )
    # 512 / 8 = 64 rows per rank (TP 8 of Qwen3-Next-80B): each rank's rows lie inside one block: accepted
    Fp8Experts(4, 256, 64, (128, 128), intermediate_range=(64, 128), full_intermediate_size=512, name="tp8")
