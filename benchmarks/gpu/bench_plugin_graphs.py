"""The plugin's whole model in full CUDA graphs over its own builders' metadata, against the same forward with
the token-mixer cores left eager (what vLLM's PIECEWISE mode runs) and fully eager.

What runs: vLLM 0.32's Python classes (``EngineArgs`` -> ``VllmConfig`` with ``FULL_AND_PIECEWISE``, vLLM's
``CommonAttentionMetadata`` and forward context) and the plugin's classes: the target
``AtomQwen3NextForCausalLM`` and the MTP draft ``AtomQwen3NextMTP`` (the target's embedding and lm_head
shared), built at Qwen3-Next-80B-A3B-FP8 width (``--layers`` of them, 3:1 GDN:attention, the FP8
checkpoint's ``quantization_config``, random weights) with an fp8 KV cache; their metadata come from the
plugin's ``AtomAttentionMetadataBuilder`` / ``AtomGDNAttentionMetadataBuilder`` (``_batch_rig`` of the
plugin's tests drives them the way vLLM's model runner does: persistent buffers, a padded batch of
``NULL_BLOCK_ID`` rows and ``PAD_SLOT_ID`` tokens).

For each k in ``--ks`` and B in ``--batches``: B requests at context ``--ctx`` (random caches) take one
decode (k = 0) or verify (1 + k tokens, k >= 1) step. The metadata are those of
``build_for_cudagraph_capture`` for B requests (vLLM's capture batch). Per (k, B):

- ``full_ms``: one CUDA graph of the target's forward + ``compute_logits`` (vLLM's FULL graph of the
  target; the draft is captured the same way), replayed; ``draft_full_ms`` the draft's forward + logits
  over the same rows (vLLM's first draft pass);
- ``piecewise_ms``: the same forward as CUDA graphs of the pieces between the cores, with each attention /
  GDN core run eagerly between them, in vLLM's forward context (what vLLM's PIECEWISE mode does around its
  splitting ops); ``eager_ms``: the forward with no graph;
- ``replay_equals_eager``: outputs (target and draft logits) and every cache / state row the step touches
  (every GDN layer's slots of the B requests, every attention layer's blocks of them) after one replay
  equal those after one eager run from the same state, bit for bit (the state copies live in host memory
  where two of them do not fit on the GPU beside the model).

``--engine-json``: the standalone engine's figures of the same run (``bench_engine.py --fp8 --out ...``,
run before this script in the same device call) are read and put beside each row: the engine's graphed
target forward (``target_ms``) and propose (``propose_ms``), and ``full / engine`` ratios. JSON + PNG as
``plugin_graphs_<gpu>.json`` / ``.png``.

Needs vLLM's Python package importable (on the GPU machine: ``scripts/gpu_vllm_bundle.sh``'s bundle and
``scripts/gpu_vllm_run.py``'s stand-ins for vLLM's compiled extensions, see ``--stand-ins``).

    python benchmarks/gpu/bench_plugin_graphs.py --layers 48 --out $OUT --engine-json $OUT/engine_h200_fp8.json
    python benchmarks/gpu/bench_plugin_graphs.py --smoke   # CPU, tiny dims: metadata and eager forward only
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "packages" / "atom-vllm-plugin" / "tests"))
import bench_engine  # noqa: E402
import common  # noqa: E402


def write_config(dims: dict, layers: int, fp8: bool, out: Path) -> Path:
    """A checkpoint directory holding only ``config.json`` at ``dims`` width (no weights, no tokenizer)."""
    hf = json.loads((ROOT / "data" / "tiny-qwen3-next-mtp" / "config.json").read_text())
    hf.update(dims)
    hf["num_hidden_layers"] = layers
    hf["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    hf["mtp_num_hidden_layers"] = 1
    hf["max_position_embeddings"] = max(hf.get("max_position_embeddings", 0), 65536)
    if fp8:
        hf["quantization_config"] = bench_engine.fp8_quantization_config(hf)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    return out


@torch.no_grad()
def randomize(rig, seed: int) -> None:
    """Random weights (as ``bench_engine.randomize``) and caches: e4m3 KV from random bf16, small GDN conv /
    recurrent states, zero pending tokens."""
    g = torch.Generator(device=rig.device).manual_seed(seed)
    bench_engine.randomize_parameters([rig.model] + ([rig.draft] if rig.draft is not None else []), g)
    for core in [*rig.attn.values(), *rig.draft_attn.values()]:
        raw = core.kv_cache
        if raw.dtype == torch.uint8:
            raw = raw.view(torch.float8_e4m3fn)
        for i in range(raw.shape[0]):  # block by block: the bf16 temporary stays small
            raw[i].copy_(torch.randn(raw[i].shape, dtype=torch.bfloat16, device=raw.device, generator=g))
    for core in rig.gdn.values():
        conv, ssm = core.kv_cache[0], core.kv_cache[1]
        conv.normal_(0.0, 0.1, generator=g)
        for i in range(ssm.shape[0]):
            ssm[i].normal_(0.0, 0.01, generator=g)
        if len(core.kv_cache) > 2:
            core.kv_cache[2].zero_()


def touched_state(rig, batch: int) -> dict[str, torch.Tensor]:
    """Views of the cache / state rows a step of requests ``0 .. batch - 1`` reads or writes: their GDN
    slots (``1 .. batch``, every state tensor of every GDN layer) and their attention blocks (target and
    draft layers); the rig puts request ``r`` in slot ``r + 1`` and blocks ``1 + r * blocks_per_req ...``."""
    blocks = slice(1, 1 + batch * rig.blocks_per_req)
    out = {n: c.kv_cache[blocks] for n, c in [*rig.attn.items(), *rig.draft_attn.items()]}
    for n, c in rig.gdn.items():
        out.update({f"{n}.{i}": t[1 : 1 + batch] for i, t in enumerate(c.kv_cache)})
    return out


def snapshot(views: dict[str, torch.Tensor], where: torch.device) -> dict[str, torch.Tensor]:
    return {n: v.to(where, copy=True) for n, v in views.items()}


class Step:
    """One (k, B) step: the capture-batch metadata and the forward(s) over the rig's static buffers."""

    def __init__(self, rig, batch: int, ctx: int, gen: torch.Generator):
        from _batch_rig import Row
        from _batch_rig import Step as RigStep

        k = rig.k
        q = 1 + k
        toks = torch.randint(1, 1000, (batch, q), generator=gen).tolist()
        acc = torch.randint(1, q + 1, (batch,), generator=gen).tolist()
        rows = [Row(r, ctx, toks[r], num_accepted=acc[r], drafts=k if k else -1) for r in range(batch)]
        self.rig = rig
        self.mds, inputs = rig.build(RigStep(rows, capture=True))
        self.ids, self.pos = inputs["input_ids"], inputs["positions"]
        self.hidden = None

    def target(self) -> torch.Tensor:
        h = self.rig.forward(self.mds, self.ids, self.pos)
        self.hidden = h
        return self.rig.model.compute_logits(h)

    def draft(self) -> torch.Tensor:
        d = self.rig.draft_forward(self.mds, self.ids, self.pos, self.hidden)
        return self.rig.draft.compute_logits(d)


class Piecewise:
    """CUDA graphs of the pieces of ``fn`` between the cores' op calls; the ops run eagerly between them, in
    vLLM's forward context of ``mds`` (what vLLM's PIECEWISE mode does around its splitting ops)."""

    def __init__(self, rig, mds, fn, pool):
        from vllm.forward_context import set_forward_context

        self.rig, self.mds = rig, mds
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.ops: list = []
        self._ctx = lambda: set_forward_context(mds, rig.vc)
        cores = [*rig.attn.values(), *rig.gdn.values(), *rig.draft_attn.values()]
        saved = {id(c): c.forward for c in cores}
        self.g = None

        def split(core, make_out, call):
            def forward(*args, **kwargs):
                out = make_out(*args)
                self.g.capture_end()
                self.pieces.append(self.g)
                op = lambda: call(out, *args)  # noqa: E731
                op()  # eagerly now (what the next piece reads), and again at every replay
                self.ops.append(op)
                self.g = torch.cuda.CUDAGraph()
                self.g.capture_begin(pool=pool)
                return out

            return forward

        from atom_vllm_plugin.layers.attention import AtomAttentionCore

        for c in cores:
            if isinstance(c, AtomAttentionCore):
                c.forward = split(c, lambda q, k, v, ctx=None: torch.empty_like(q), _attn_call(c))
            else:
                c.forward = split(c, _gdn_out(c), _gdn_call(c))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                self.g = torch.cuda.CUDAGraph()
                self.g.capture_begin(pool=pool)
                self.result = fn()
                self.g.capture_end()
                self.pieces.append(self.g)
        finally:
            for c in cores:
                c.forward = saved[id(c)]
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self) -> None:
        with self._ctx():
            for i, g in enumerate(self.pieces):
                g.replay()
                if i < len(self.ops):
                    self.ops[i]()


def _attn_call(core):
    def call(out, q, k, v, ctx=None):
        core.run_into(out, q, k, v)

    return call


def _gdn_out(core):
    geo = core.state.geometry

    def make(mixed_qkv, b, a, weights, ctx=None):
        return mixed_qkv.new_empty(mixed_qkv.shape[0], geo.num_v_heads, geo.head_v_dim)

    return make


def _gdn_call(core):
    def call(out, mixed_qkv, b, a, weights, ctx=None):
        core.run_into(out, mixed_qkv, b, a, weights)

    return call


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, list[str]]:
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    return not bad, bad


def bench_case(rig, step: Step, batch: int, with_draft: bool, reps_ms: int) -> dict:
    """Eager vs one replay from the same state (bit for bit), then the timings of full / piecewise / eager."""
    dev = rig.device
    views = touched_state(rig, batch)
    nbytes = sum(v.numel() * v.element_size() for v in views.values())
    # two copies (the start state and eager's end state): on the GPU where they fit, else in host memory
    where = dev if 3 * nbytes < torch.cuda.mem_get_info()[0] else torch.device("cpu")
    snap = snapshot(views, where)

    def both():
        lg = step.target()
        return (lg, step.draft()) if with_draft else (lg,)

    def restore():
        for n, v in views.items():
            v.copy_(snap[n])

    ref = [t.clone() for t in both()]  # eager, from the snapshot
    ref_states = snapshot(views, where)
    for _ in range(2):  # warm-up (Triton compiles, the allocator settles)
        both()
    torch.cuda.synchronize(dev)
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for name, fn in [("target", step.target)] + ([("draft", step.draft)] if with_draft else []):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = fn()
        graphs[name] = (g, out)
    restore()
    graphs["target"][0].replay()
    if with_draft:
        graphs["draft"][0].replay()
    torch.cuda.synchronize(dev)
    outs = [graphs["target"][1]] + ([graphs["draft"][1]] if with_draft else [])
    same_out = all(torch.equal(a, b) for a, b in zip(ref, outs))
    bad = [n for n, v in views.items() if not torch.equal(ref_states[n], v.to(where))]
    row = {
        "replay_equals_eager": bool(same_out and not bad),
        "state_checked_gib": round(nbytes / 2**30, 2),
        "state_copies_on": where.type,
    }
    if not (same_out and not bad):
        row["mismatch"] = {"outputs": not same_out, "states": bad[:8]}
        row["max_out_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, outs))
    restore()
    del ref, ref_states
    # timings (each run changes the state; the step's work does not depend on it)
    row["full_ms"] = common.time_ms(graphs["target"][0].replay, rep_ms=reps_ms)
    if with_draft:
        row["draft_full_ms"] = common.time_ms(graphs["draft"][0].replay, rep_ms=reps_ms)
    pw = Piecewise(rig, step.mds, step.target, pool)
    row["piecewise_ms"] = common.time_ms(pw.replay, rep_ms=reps_ms)
    row["eager_ms"] = common.time_ms(step.target, rep_ms=reps_ms)
    if with_draft:
        row["draft_eager_ms"] = common.time_ms(step.draft, rep_ms=reps_ms)
    row["piecewise_over_full"] = row["piecewise_ms"] / row["full_ms"]
    row["eager_over_full"] = row["eager_ms"] / row["full_ms"]
    del graphs, pw
    return row


def engine_rows(path: str | None) -> dict[tuple[int, int], dict]:
    if not path or not Path(path).exists():
        return {}
    data = json.loads(Path(path).read_text())
    out = {}
    for r in data.get("rows", []):
        if "k" in r and "B" in r:
            out[(int(r["k"]), int(r["B"]))] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--engine-json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny dims: build, metadata, eager forward")
    args = ap.parse_args()

    from _batch_rig import BatchRig

    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    out = common.out_dir(args.out)
    dims = bench_engine.SMOKE if smoke else bench_engine.WIDE
    cfg_dir = write_config(
        dims, 4 if smoke else args.layers, fp8=not smoke, out=Path(tempfile.mkdtemp()) / "ckpt"
    )
    env = {} if smoke else common.environment()
    engine = engine_rows(args.engine_json)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for k in args.ks:
        t0 = time.time()
        rig = BatchRig(
            str(cfg_dir),
            k,
            num_reqs=max(args.batches),
            max_len=args.ctx + 8,
            dtype="float32" if smoke else "bfloat16",
            kv_cache_dtype="auto" if smoke else "fp8",
            device=device,
            load=False,
            draft=k > 0,
        )
        randomize(rig, seed=k)
        build_s = time.time() - t0
        for batch in args.batches:
            step = Step(rig, batch, args.ctx, gen)
            with torch.inference_mode():
                if smoke:
                    lg = step.target()
                    row = {"k": k, "batch": batch, "logits_shape": list(lg.shape)}
                    if k > 0:
                        row["draft_logits_shape"] = list(step.draft().shape)
                else:
                    row = {"k": k, "batch": batch, "build_s": build_s}
                    row |= bench_case(rig, step, batch, k > 0, args.rep_ms)
                    eng = engine.get((k, batch))
                    if eng:
                        for key in ("target_ms_graphed", "propose_ms_graphed", "step_ms_graphed"):
                            if key in eng:
                                row[f"engine_{key}"] = eng[key]
                        if "target_ms_graphed" in eng:
                            row["full_over_engine_target"] = row["full_ms"] / eng["target_ms_graphed"]
            print(json.dumps(row), flush=True)
            rows.append(row)
            partial = {
                "environment": env,
                "layers": args.layers,
                "ctx": args.ctx,
                "rows": rows,
                "partial": True,
            }
            common.write_json(out / "plugin_graphs_partial.json", partial)
            del step
        del rig
        gc.collect()
        if not smoke:
            torch.cuda.empty_cache()
    gpu = "cpu" if smoke else common.gpu_tag(torch.device("cuda"))
    payload = {"environment": env, "layers": args.layers, "ctx": args.ctx, "rows": rows}
    common.write_json(out / f"plugin_graphs_{gpu}.json", payload)
    if not smoke:
        common.print_table(
            rows,
            ["k", "batch", "full_ms", "piecewise_ms", "eager_ms", "draft_full_ms", "replay_equals_eager"],
        )
        plot(rows, out / f"plugin_graphs_{gpu}.png")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    labels = [f"k={r['k']} B={r['batch']}" for r in rows]
    x = range(len(rows))
    width = 0.2
    series = [("full_ms", "full graph"), ("piecewise_ms", "piecewise (cores eager)"), ("eager_ms", "eager")]
    if any("engine_target_ms_graphed" in r for r in rows):
        series.append(("engine_target_ms_graphed", "engine target (graphed)"))
    for i, (key, name) in enumerate(series):
        ax.bar([j + i * width for j in x], [r.get(key, 0) for r in rows], width, label=name)
    ax.set_xticks([j + width for j in x])
    ax.set_xticklabels(labels, rotation=45, ha="right")
    ax.set_ylabel("ms per target forward")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Plugin target forward: full CUDA graph vs piecewise vs eager")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
