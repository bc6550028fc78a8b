"""The vLLM plugin's cores, captured in a CUDA graph and replayed, against eager: on a machine without vLLM.

vLLM's CUDA build cannot be installed on the GPU machine, so vLLM's modules that the plugin's core layers
import are replaced by minimal stand-ins (``_shim_vllm``: base classes and enums only; no vLLM code runs).
What is captured is the plugin's own per-step code path, through each core's ``run(md, ...)`` entry (the
body of the ``vllm::atom_attention_with_output`` / ``vllm::atom_gdn_core`` ops) with metadata built by hand
the way the plugin's builders build it:

- ``AtomGDNCore.run`` (``atom_models.gdn_pipeline.gdn_forward``) on a decode step (B requests, 1 token)
  and on a verify step (B requests, 1 + k tokens, deferred commit of ``num_accepted`` pending tokens),
  with padding rows (slot -1) in the batch: conv / recurrent / pending state updated in place;
- ``AtomAttentionCore.run`` on the same two step shapes: KV-cache write at ``slot_mapping`` + paged
  attention over each request's cached context, output written into a static buffer.

For each (core, step): the states are snapshotted; an eager run gives the reference outputs and states;
the states are restored, the step is captured (``torch.cuda.graph``) and replayed twice, with fresh input
values copied into the static inputs before the second replay (eager is rerun on the same values). Outputs
and every state tensor must match eager (max |diff| reported; identical kernels, so expected 0).
Geometry: one Qwen3-Next-80B-A3B layer of each kind (GDN 16/32 heads of 128, attention 16/2 heads of 256),
bf16, context ``--ctx`` tokens, B in ``--batches``, k in ``--ks``.

    # on the GPU machine (no vLLM), from the repository root:
    PYTHONPATH=packages/atom-core/src:packages/atom-kernels/src:packages/atom-models/src:packages/atom-vllm-plugin/src \\
        python benchmarks/gpu/capture_plugin_cores.py --out $OUT
    # CPU (here): everything up to the capture (eager runs, metadata, shims), then stops
    uv run --no-sync python benchmarks/gpu/capture_plugin_cores.py --device cpu --batches 2 --ctx 16
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


# ---- stand-ins for the vLLM modules the plugin's core layers import ------------------------------------
def _shim_vllm(force: bool = False) -> bool:
    """Install stand-in ``vllm.*`` modules when vLLM is not importable (or ``force``); return whether shims
    were used. ``atom_vllm_plugin/__init__`` refuses to import without vLLM, so the package is entered
    without it (its submodules are what the cores need)."""
    import importlib.util

    if not force and importlib.util.find_spec("vllm") is not None:
        return False
    spec = importlib.util.find_spec("atom_vllm_plugin")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("atom_vllm_plugin is not on the path (PYTHONPATH=...packages/atom-vllm-plugin/src)")
    pkg = types.ModuleType("atom_vllm_plugin")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["atom_vllm_plugin"] = pkg

    def mod(name: str, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class _Base:
        def __init__(self, *args, **kwargs) -> None:
            pass

    class AttentionCGSupport(enum.Enum):
        ALWAYS = 3
        UNIFORM_BATCH = 2
        UNIFORM_SINGLE_TOKEN_DECODE = 1
        NEVER = 0

    class AttentionMetadataBuilder(_Base):
        def __class_getitem__(cls, item):
            return cls

    @dataclasses.dataclass
    class GDNAttentionMetadata:  # vLLM's fields are not needed by the cores' run()
        pass

    class MambaAttentionBackendEnum(enum.Enum):
        GDN_ATTN = "GDN_ATTN"

    class KVCacheLayout(enum.Enum):
        NHD = "NHD"
        HND = "HND"
        LBNHC = "LBNHC"

    names = ["vllm", "vllm.config", "vllm.forward_context", "vllm.utils", "vllm.utils.torch_utils",
             "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.attention_layer_base",
             "vllm.model_executor.layers.mamba", "vllm.model_executor.layers.mamba.abstract", "vllm.v1",
             "vllm.v1.kv_cache_interface", "vllm.v1.kv_cache_layout", "vllm.v1.attention",
             "vllm.v1.attention.backend", "vllm.v1.attention.backends", "vllm.v1.attention.backends.registry",
             "vllm.v1.attention.backends.gdn_attn"]  # fmt: skip
    for n in names:
        mod(n)
    sys.modules["vllm.config"].__dict__.update(VllmConfig=object, get_current_vllm_config=lambda: None)
    sys.modules["vllm.forward_context"].__dict__.update(
        get_forward_context=lambda: None, is_forward_context_available=lambda: False
    )
    sys.modules["vllm.utils.torch_utils"].__dict__.update(
        direct_register_custom_op=lambda *a, **k: None, kv_cache_dtype_str_to_dtype=lambda *a, **k: None
    )
    sys.modules["vllm.model_executor.layers.attention_layer_base"].AttentionLayerBase = type(
        "AttentionLayerBase", (), {}
    )
    sys.modules["vllm.model_executor.layers.mamba.abstract"].MambaBase = type("MambaBase", (), {})
    sys.modules["vllm.v1.kv_cache_interface"].__dict__.update(
        FullAttentionSpec=_Base, KVCacheSpec=_Base, AttentionSpec=_Base
    )
    sys.modules["vllm.v1.kv_cache_layout"].KVCacheLayout = KVCacheLayout
    sys.modules["vllm.v1.attention.backend"].__dict__.update(
        AttentionBackend=_Base,
        AttentionCGSupport=AttentionCGSupport,
        AttentionMetadataBuilder=AttentionMetadataBuilder,
        CommonAttentionMetadata=_Base,
        MultipleOf=_Base,
    )
    sys.modules["vllm.v1.attention.backends.registry"].MambaAttentionBackendEnum = MambaAttentionBackendEnum
    sys.modules["vllm.v1.attention.backends.gdn_attn"].__dict__.update(
        GDNAttentionBackend=_Base,
        GDNAttentionMetadata=GDNAttentionMetadata,
        GDNAttentionMetadataBuilder=_Base,
    )
    return True


WIDE = {
    "hidden_size": 2048,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "num_hidden_layers": 4,
}


def model_config():
    from atom_core import Qwen3NextConfig

    hf = json.loads((ROOT / "data" / "tiny-qwen3-next-mtp" / "config.json").read_text())
    hf.update(WIDE)
    hf["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    return Qwen3NextConfig.from_hf(hf)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    d = (a.float() - b.float()).abs()
    d = d[~(a.float().isnan() & b.float().isnan())]
    return float(d.max()) if d.numel() else 0.0


class Case:
    """One core on one step shape: ``step()`` runs it on the static inputs, ``states`` are mutated."""

    def __init__(self, name, step, inputs: list[torch.Tensor], states: list[torch.Tensor], out: torch.Tensor):
        self.name, self.step, self.inputs, self.states, self.out = name, step, inputs, states, out

    def snapshot(self):
        return [s.clone() for s in self.states]

    def restore(self, snap) -> None:
        for s, v in zip(self.states, snap):
            s.copy_(v)

    def refill(self, gen: torch.Generator) -> None:
        for t in self.inputs:
            t.copy_(torch.randn(t.shape, generator=gen, device="cpu").to(t.device, t.dtype))

    def eager(self):
        self.step()
        return self.out.clone(), [s.clone() for s in self.states]


def gdn_case(cfg, kernels, dtype, device, batch: int, q_len: int, k: int, ctx: int, gen) -> Case:
    from atom_models.gdn import GatedDeltaNet
    from atom_models.gdn_meta import GDNDecodeMeta, GDNStepMeta, GDNVerifyMeta
    from atom_vllm_plugin.layers.gdn import AtomGDNCore
    from atom_vllm_plugin.layers.gdn_backend import AtomGDNAttentionMetadata
    from atom_vllm_plugin.layers.gdn_state import GDNStateSpec

    layer = GatedDeltaNet(cfg, 0, core=None, kernels=kernels, dtype=dtype).to(device)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2.0)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    spec = GDNStateSpec.from_config(cfg, k, dtype, torch.float32)
    core = AtomGDNCore(f"model.layers.0.linear_attn.k{k}.b{batch}", spec, kernels)
    num_slots = batch + 2
    core.kv_cache = tuple(
        (torch.randn((num_slots, *shape), generator=gen) * 0.1).to(device, dt)
        for shape, dt in zip(spec.shapes(), spec.dtypes)
    )
    # the last row of the batch is padding (slot -1): vLLM pads a graph's batch up to its captured size
    slots = torch.tensor([*range(batch - 1), -1], dtype=torch.int32, device=device) if batch > 1 else None
    if slots is None:
        slots = torch.zeros(1, dtype=torch.int32, device=device)
    if q_len == 1 and k == 0:
        step_meta = GDNStepMeta(decodes=(GDNDecodeMeta(batch, slots),))
    else:
        accepted = torch.tensor([1 + (i % (k + 1)) for i in range(batch)], dtype=torch.int32, device=device)
        step_meta = GDNStepMeta(verifies=(GDNVerifyMeta(batch, q_len, slots, accepted),))
    assert step_meta.capturable
    md = AtomGDNAttentionMetadata(step=step_meta)
    t = batch * q_len
    x = torch.randn(t, layer.conv_dim, generator=gen).to(device, dtype)
    b = torch.randn(t, layer.num_v_heads, generator=gen).to(device, dtype)
    a = torch.randn(t, layer.num_v_heads, generator=gen).to(device, dtype)
    weights = layer.gdn_weights()
    out = torch.empty(t, layer.num_v_heads, layer.head_v_dim, device=device, dtype=dtype)
    pad = " (last row padding, slot -1)" if batch > 1 else ""
    name = f"gdn {'decode' if k == 0 else 'verify'} k={k} B={batch}{pad}"
    return Case(name, lambda: out.copy_(core.run(md, x, b, a, weights)), [x, b, a], list(core.kv_cache), out)


def attention_case(cfg, kernels, dtype, device, batch: int, q_len: int, k: int, ctx: int, gen) -> Case:
    from atom_vllm_plugin.layers.attention import AtomAttentionCore
    from atom_vllm_plugin.layers.attention_backend import AtomAttentionMetadata

    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    core = AtomAttentionCore(f"model.layers.3.self_attn.k{k}.b{batch}", hq, hkv, d, kernels, dtype)
    block = 64
    per_req = -(-(ctx + q_len) // block)
    num_blocks = batch * per_req + 1
    # vLLM's LBNHC physical layout [block, token, head, 2D], handed to the layer as [block, head, token, 2D]
    phys = (torch.randn(num_blocks, block, hkv, 2 * d, generator=gen) * 0.5).to(device, dtype)
    core.kv_cache = phys.transpose(1, 2)
    block_table = torch.arange(batch * per_req, dtype=torch.int32, device=device).view(batch, per_req)
    seq_lens = torch.full((batch,), ctx + q_len, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    pos = torch.arange(ctx, ctx + q_len, device=device)
    slot = (block_table.long()[:, pos // block] * block + pos % block).reshape(-1)
    t = batch * q_len
    md = AtomAttentionMetadata(
        num_actual_tokens=t, num_reqs=batch, max_query_len=q_len, query_start_loc=qsl, seq_lens=seq_lens,
        block_table=block_table, slot_mapping=slot,
    )  # fmt: skip
    q = torch.randn(t, hq, d, generator=gen).to(device, dtype)
    kk = torch.randn(t, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(device, dtype)
    out = torch.empty(t, hq, d, device=device, dtype=dtype)
    name = f"attention {'decode' if q_len == 1 else 'verify'} k={k} B={batch} ctx={ctx}"
    return Case(name, lambda: core.run(md, q, kk, v, out=out), [q, kk, v], [phys], out)


def check(case: Case, device: str, gen: torch.Generator) -> dict:
    row: dict = {"case": case.name}
    snap = case.snapshot()
    ref_out, ref_states = case.eager()
    case.restore(snap)
    if device != "cuda":  # no capture here: check that a rerun from the restored states repeats eager
        row["captured"] = False
        rerun_out, rerun_states = case.eager()
        case.restore(snap)
        row["eager_out_finite"] = bool(torch.isfinite(ref_out.float()).all())
        row["rerun_maxdiff"] = max(
            [_maxdiff(rerun_out, ref_out)] + [_maxdiff(s, r) for s, r in zip(rerun_states, ref_states)]
        )
        row["ok"] = row["eager_out_finite"] and row["rerun_maxdiff"] == 0.0
        return row
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (triton compiles, allocations) off the capture
        for _ in range(2):
            case.step()
            case.restore(snap)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        case.step()
    case.restore(snap)  # capture records, it does not run; restore anyway (warm-up ran on the states)
    torch.cuda.set_sync_debug_mode("error")
    try:
        g.replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    row["replay1_out_maxdiff"] = _maxdiff(case.out, ref_out)
    row["replay1_state_maxdiff"] = max(_maxdiff(s, r) for s, r in zip(case.states, ref_states))
    # second replay on fresh input values (copied into the static inputs), from the same states
    case.restore(snap)
    case.refill(gen)
    snap2 = case.snapshot()
    ref2_out, ref2_states = case.eager()
    case.restore(snap2)
    g.replay()
    torch.cuda.synchronize()
    row["replay2_out_maxdiff"] = _maxdiff(case.out, ref2_out)
    row["replay2_state_maxdiff"] = max(_maxdiff(s, r) for s, r in zip(case.states, ref2_states))
    row["replay2_inputs_changed_output"] = _maxdiff(ref2_out, ref_out) > 0
    row["captured"] = True
    row["ok"] = all(row[f"replay{i}_{w}_maxdiff"] == 0.0 for i in (1, 2) for w in ("out", "state")) and bool(
        row["replay2_inputs_changed_output"]
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--out", default=None, help="directory for capture_plugin_cores.json")
    ap.add_argument(
        "--force-shim", action="store_true", help="use the vLLM stand-ins even where vLLM is installed"
    )
    args = ap.parse_args()
    shimmed = _shim_vllm(args.force_shim)
    from atom_kernels import select_kernels

    dtype = getattr(torch, args.dtype)
    device = args.device
    kernels = select_kernels(device, dtype)
    cfg = model_config()
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for k in args.ks:
            q_len = 1 + k
            for batch in args.batches:
                for make in (gdn_case, attention_case):
                    case = make(cfg, kernels, dtype, device, batch, q_len, k, args.ctx, gen)
                    t0 = time.perf_counter()
                    row = {**check(case, device, gen), "seconds": round(time.perf_counter() - t0, 3)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    result = {
        "benchmark": "capture_plugin_cores",
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "vllm_shimmed": shimmed,
        "backends": {op: kernels.backend_of(op) for op in ("paged_attention", "gated_delta_rule_verify")},
        "args": vars(args),
        "rows": rows,
        "all_ok": all(r.get("ok", False) for r in rows),
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "capture_plugin_cores.json").write_text(json.dumps(result, indent=1))
    print("all_ok:", result["all_ok"], "| shimmed vLLM:", shimmed)
    if not result["all_ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
