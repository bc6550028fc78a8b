"""Op-by-op bf16 comparison of stock vLLM's Qwen3-Next (its CPU ops) and atom_models on one checkpoint.

Stock vLLM (``ATOM_DISABLE_VLLM_PLUGIN=1``, bf16, enforce_eager, in-process engine and worker) prefills
one prompt of the bundled ``prompts.json`` with forward hooks on its modules; each hooked module's inputs
and outputs are kept. atom_models' bf16 model (cpu kernels, dense cores) then runs each corresponding
module on *stock's* inputs, so every row isolates one op's rounding from the error carried in from the
layers before: the fraction of elements that are not bit-equal and the largest absolute difference.
Stock's hooks see a module's inputs after it ran, so in-place ops (the rotary embedding) are compared on
the outputs of the op before them; a module that the layers share (the rotary embedding) is compared at
its first call only.

The GDN core is a custom op in stock (no module to hook), so its parts are compared by calling stock's
CPU kernels (``vllm._custom_ops``: ``fused_gdn_gating_cpu``, ``chunk_gated_delta_rule_cpu``,
``fused_sigmoid_gating_delta_rule_update_cpu``) and ours on the same inputs (our conv of stock's
projections): the gating, the chunked delta rule over all but the last prompt token (both sides given
stock's gates), the state it leaves, and one decode step of the last token from that state (gating fused
in, each side with its own parameters: stock rounds ``A_log`` to bf16, atom_models keeps the checkpoint's
float32 value). For these rows and the attention core each side is
also compared with the exact value (float64 from the same bf16 inputs): ``ours_vs_exact`` and
``stock_vs_exact`` say which side rounds closer.

    uv run --no-sync python benchmarks/bf16_op_compare.py MODEL_DIR [--prompt 0] [--out rows.json]

Results: ``benchmarks/results/bf16_op_compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

HOOKED = (
    "input_layernorm",
    "post_attention_layernorm",
    "linear_attn",
    "linear_attn.norm",
    "linear_attn.in_proj_qkvz",
    "linear_attn.in_proj_ba",
    "linear_attn.out_proj",
    "self_attn",
    "self_attn.o_proj",
    "self_attn.qkv_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "self_attn.rotary_emb",
    "self_attn.attn",
    "mlp",
    "mlp.gate",
    "mlp.experts",
    "mlp.shared_expert",
    "mlp.shared_expert_gate",
)


def _tensors(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_tensors(v) for v in x)
    if isinstance(x, dict):
        return {k: _tensors(v) for k, v in x.items()}
    return x if isinstance(x, (int, float, bool, str, type(None))) else repr(type(x))


def capture_stock(model: Path, prompt: list[int]) -> dict:
    os.environ["ATOM_DISABLE_VLLM_PLUGIN"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=512,
        distributed_executor_backend="uni",
        seed=0,
    )
    store: dict = {}

    def install(m):
        for name, mod in m.named_modules():
            short = name.split("layers.", 1)[-1] if "layers." in name else name
            tail = short.split(".", 1)[-1] if "layers." in name else short
            if tail in HOOKED or name in ("model.norm", "logits_processor", "lm_head"):

                def hook(mod, args, kwargs, out, name=name):
                    store.setdefault(name, (_tensors(args), _tensors(kwargs), _tensors(out)))

                mod.register_forward_hook(hook, with_kwargs=True)
        return True

    llm.apply_model(install)
    llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False
    )
    return store


def diff(ours, stock) -> dict:
    """Fraction of elements not bit-equal and the largest absolute difference (both as float32)."""
    a, b = ours.float(), stock.float().reshape(ours.shape)
    d = (a - b).abs()
    return {"not_equal": round(float((d > 0).float().mean()), 4), "max_abs": float(d.max())}


def exact_diff(ours, stock, exact) -> dict:
    """:func:`diff` of ours and stock plus each side's largest absolute difference from ``exact``."""
    e = exact.float()
    row = diff(ours, stock)
    row["ours_vs_exact"] = float((ours.float().reshape(e.shape) - e).abs().max())
    row["stock_vs_exact"] = float((stock.float().reshape(e.shape) - e).abs().max())
    return row


def exact_delta_rule(q, k, v, g, beta, scale: float, state=None):
    """The gated delta rule in float64, token by token: q, k ``[T, Hk, D]`` (L2-normalised here, eps
    1e-6 as the float32 model), v ``[T, Hv, Dv]``, g, beta ``[T, Hv]``, state ``[Hv, Dv, Dk]`` or None
    (zeros). Returns ``(o [T, Hv, Dv], state)``."""
    import torch

    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    s = torch.zeros(v.shape[1], v.shape[2], q.shape[2], dtype=torch.float64) if state is None else state
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(v.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", s, k[t]))
        s = s + u[:, :, None] * k[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", s, q[t])
    return out, s


def exact_attention(q, k, v):
    """Causal softmax attention in float64 (scale ``D ** -0.5``), q ``[T, H, D]``, k/v ``[T, Hkv, D]``."""
    import torch

    t, h, d = q.shape
    k = k.double().repeat_interleave(h // k.shape[1], 1)
    v = v.double().repeat_interleave(h // v.shape[1], 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * d**-0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def gdn_core_rows(kern, la, mixed, b, a) -> list[tuple[str, dict]]:
    """Stock's GDN CPU kernels and ours on the same inputs (module docstring): gating, the chunked rule
    over tokens ``0..T-2``, the state it leaves, one decode step of token ``T-1``."""
    import torch
    import vllm._custom_ops as ops
    from atom_models.gdn_state import GDNLayerState

    geo, w, bf = la.core.geometry, la.gdn_weights(), torch.bfloat16
    a, b = a.contiguous(), b.contiguous()
    t = mixed.shape[0] - 1
    cu = torch.tensor([0, t], dtype=torch.int32)
    slot, fresh = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.bool)
    conv = GDNLayerState.allocate(geo, 1, conv_dtype=mixed.dtype, ssm_dtype=torch.float32, device="cpu").conv
    xc = kern.causal_conv1d_varlen(
        mixed, w.conv_weight, w.conv_bias, torch.tensor([0, t + 1], dtype=torch.int32), conv, slot, fresh
    )
    q, k, v = (x.contiguous() for x in geo.split_qkv(xc))
    a_log, dt_bias = w.A_log.to(bf), w.dt_bias.to(bf)  # stock's parameters are bf16
    g_s, beta_s = ops.fused_gdn_gating_cpu(a_log, a, b, dt_bias)
    g_s, beta_s = g_s.view(a.shape), beta_s.view(b.shape)
    g_o, beta_o = kern.gdn_gating(w.A_log, a, w.dt_bias, b)
    # exact: the checkpoint's parameters as our model holds them (A_log float32, dt_bias bf16)
    g64 = -w.A_log.double().exp() * torch.nn.functional.softplus(a.double() + w.dt_bias.double())
    rows = [
        ("gdn gating g", exact_diff(g_o, g_s, g64)),
        ("gdn gating beta", exact_diff(beta_o, beta_s, torch.sigmoid(b.double()))),
    ]
    # the chunked rule on identical gates (stock's g, beta) for both sides
    g, beta = g_s[:t].float(), beta_s[:t].float()
    o64, s64 = exact_delta_rule(q[:t], k[:t], v[:t], g, beta, geo.scale)
    state_s = torch.zeros(1, *geo.ssm_shape)  # stock's kernels hold the state as [Hv, Dk, Dv]
    o_s, _ = ops.chunk_gated_delta_rule_cpu(
        q[None, :t], k[None, :t], v[None, :t], g_s[None, :t], beta_s[None, :t], state_s, True, cu, False, True,
        slot,
    )  # fmt: skip
    state_o = torch.zeros(1, *geo.ssm_shape)
    o_o = kern.gated_delta_rule_chunked(q[:t], k[:t], v[:t], g, beta, cu, state_o, slot, fresh, geo.scale)
    rows.append(("gdn delta rule prefill", exact_diff(o_o, o_s[0], o64)))
    rows.append(("gdn state after prefill", exact_diff(state_o[0], state_s[0].transpose(-1, -2), s64)))
    # one decode step (gating fused in) of the last token, each side from its own state
    dec = (q[t:][None], k[t:][None], v[t:][None])
    o_s = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        a_log, dt_bias, *dec, a[t:], b[t:], state_s, slot, torch.tensor([0, 1], dtype=torch.int32), True
    )
    o_o = kern.gated_delta_rule_recurrent(
        *dec, a[t:][None], b[t:][None], state_o, slot, geo.scale, A_log=w.A_log, dt_bias=w.dt_bias
    )
    beta64 = torch.sigmoid(b[t:].double())
    o64, _ = exact_delta_rule(q[t:], k[t:], v[t:], g64[t:], beta64, geo.scale, s64)
    rows.append(("gdn delta rule decode", exact_diff(o_o[0], o_s.view(o64.shape), o64)))
    return rows


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _arg(call, i: int, name: str):
    args, kwargs, _ = call
    return args[i] if len(args) > i else kwargs[name]


def _norm_rows(norm, call) -> dict:
    args, kwargs, out = call
    res = kwargs.get("residual", args[1] if len(args) > 1 else None)
    got = norm(args[0]) if res is None else norm(args[0], res)
    return diff(_first(got), _first(out))


def compare(model: Path, store: dict) -> list[tuple[str, dict]]:
    """Each atom_models module run on stock's captured inputs against stock's output of that module."""
    import torch
    from atom_core import Qwen3NextConfig
    from atom_kernels import select_kernels
    from atom_models import DenseContext, DenseCoreFactory, Qwen3NextForCausalLM, load_target

    kern = select_kernels("cpu", torch.bfloat16)
    ours = Qwen3NextForCausalLM(Qwen3NextConfig.from_hf(model), DenseCoreFactory(kern), kern, torch.bfloat16)
    load_target(ours, model)
    ours.eval()
    rows: list[tuple[str, dict]] = []
    with torch.no_grad():
        for i, layer in enumerate(ours.model.layers):
            p = f"model.layers.{i}."
            rows.append(
                (f"{i} input_layernorm", _norm_rows(layer.input_layernorm, store[p + "input_layernorm"]))
            )
            if layer.layer_type == "linear_attention":
                la, call = layer.linear_attn, store[p + "linear_attn"]
                h = _arg(call, 0, "hidden_states")
                ctx = DenseContext((h.shape[0],))
                rows.append((f"{i} linear_attn", diff(la(torch.arange(h.shape[0]), h, ctx), _first(call[2]))))
                mixed, z, b, a = la.split_projections(la.in_proj_qkvz(h), la.in_proj_ba(h))
                core_in = _arg(store[p + "linear_attn.norm"], 0, "x")  # stock's core output
                rows.append((f"{i}   gdn core", diff(la.core(mixed, b, a, la.gdn_weights(), ctx), core_in)))
                rows += [(f"{i}     {name}", r) for name, r in gdn_core_rows(kern, la, mixed, b, a)]
                call = store[p + "linear_attn.norm"]
                o, zz = _arg(call, 0, "x"), _arg(call, 1, "z")
                got = kern.gated_rms_norm(o, zz, la.norm.weight, la.norm.eps)
                rows.append((f"{i}   gated norm", diff(got, _first(call[2]))))
                call = store[p + "linear_attn.out_proj"]
                rows.append((f"{i}   out_proj", diff(la.out_proj(call[0][0]), _first(call[2]))))
            else:
                sa, call = layer.self_attn, store[p + "self_attn"]
                pos, h = _arg(call, 0, "positions"), _arg(call, 1, "hidden_states")
                t, d = h.shape[0], sa.head_dim
                rows.append((f"{i} self_attn", diff(sa(pos, h, DenseContext((t,))), _first(call[2]))))
                for n in ("q_norm", "k_norm"):
                    call = store[p + "self_attn." + n]
                    rows.append((f"{i}   {n}", diff(getattr(sa, n)(call[0][0]), _first(call[2]))))
                # stock's rotary op works in place: its inputs are the norms' outputs
                q, k = store[p + "self_attn.q_norm"][2], store[p + "self_attn.k_norm"][2]
                qo, ko = kern.rope(q.view(t, -1, d), k.view(t, -1, d), pos, sa.rotary_dim, sa.rope_theta)
                if p + "self_attn.rotary_emb" in store:  # one module shared by the layers: its first call
                    rq, rk = store[p + "self_attn.rotary_emb"][2]
                    rows.append((f"{i}   rope q", diff(qo, rq)))
                    rows.append((f"{i}   rope k", diff(ko, rk)))
                call = store[p + "self_attn.attn"]
                q, k, v = (call[0][j].view(t, -1, d) for j in range(3))
                got = sa.core(q, k, v, DenseContext((t,)))
                rows.append((f"{i}   attention core", exact_diff(got, call[2], exact_attention(q, k, v))))
                call = store[p + "self_attn.o_proj"]
                rows.append((f"{i}   o_proj", diff(sa.o_proj(call[0][0]), _first(call[2]))))
            rows.append(
                (
                    f"{i} post_attention_layernorm",
                    _norm_rows(layer.post_attention_layernorm, store[p + "post_attention_layernorm"]),
                )
            )
            mlp, call = layer.mlp, store[p + "mlp"]
            x = _arg(call, 0, "hidden_states")
            rows.append((f"{i} mlp", diff(mlp(x), _first(call[2]))))
            if (
                hasattr(mlp, "gate")
                and mlp.gate.weight.shape[0] == _first(store[p + "mlp.gate"][2]).shape[-1]
            ):
                rows.append((f"{i}   router logits", diff(mlp.gate(x), _first(store[p + "mlp.gate"][2]))))
            if getattr(mlp, "shared_expert", None) is not None:  # stock's shared expert applies its gate
                got = torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
                rows.append(
                    (f"{i}   gated shared expert", diff(got, _first(store[p + "mlp.shared_expert"][2])))
                )
        rows.append(("final norm", _norm_rows(ours.model.norm, store["model.norm"])))
        call = store["logits_processor"]
        hidden = _arg(call, 1, "hidden_states")
        rows.append(("logits", diff(ours.compute_logits(hidden), call[2])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--prompt", type=int, default=0)
    ap.add_argument("--dump", type=Path, default=None, help="save stock's captures (torch.save)")
    ap.add_argument("--load", type=Path, default=None, help="stock's captures from an earlier --dump")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = ap.parse_args()
    from atom_core.paths import reference_dir

    raw = json.loads((reference_dir() / "prompts.json").read_text())
    prompt = raw["prompts"][args.prompt]["prompt_token_ids"]
    import torch

    store = torch.load(args.load, weights_only=False) if args.load else capture_stock(args.model, prompt)

    if args.dump:
        torch.save(store, args.dump)
    rows = compare(args.model, store)
    for name, r in rows:
        exact = (
            f"  vs exact: ours {r['ours_vs_exact']:.3e} stock {r['stock_vs_exact']:.3e}"
            if "ours_vs_exact" in r
            else ""
        )
        print(f"{name:34s} not bit-equal {r['not_equal']:.4f}  max |diff| {r['max_abs']:.3e}{exact}")
    if args.out:
        args.out.write_text(
            json.dumps({"model": str(args.model), "prompt": args.prompt, "ops": dict(rows)}, indent=1)
        )


if __name__ == "__main__":
    main()
