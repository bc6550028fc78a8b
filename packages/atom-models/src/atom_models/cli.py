"""``atom-generate``: generate with the standalone engine (optionally with MTP speculative decoding)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from atom_core.paths import default_model_dir

from atom_models.engine import EngineConfig, LLMEngine, SamplingParams, SpecStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atom-generate", description=__doc__)
    p.add_argument(
        "--model", type=Path, default=None, help="HF checkpoint dir (default: data/tiny-qwen3-next-mtp)"
    )
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--speculative-tokens", type=int, default=0, help="MTP drafts per step (0: no speculation)"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda (with --tensor-parallel-size N > 1, rank r runs on cuda:r over NCCL, or on the CPU over gloo)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="tensor-parallel ranks, one spawned process each (default 1: this process)",
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="partition the routed experts over the tensor-parallel ranks (whole experts, 1/tp per rank) "
        "instead of splitting each expert's intermediate dimension",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode/verify steps from CUDA graphs (default: on for a CUDA device, off otherwise)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; the bundled tiny model is fastest with 1 (raise it for large models)",
    )
    return p


def _tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"atom-generate: {path} not found (the tokenizer is read from tokenizer.json)")
    return Tokenizer.from_file(str(path))


def summary(stats: SpecStats, k: int) -> str:
    if k == 0:
        return "speculative decoding off"
    per_pos = ", ".join(str(v) for v in stats.accepted_per_position)
    return (
        f"MTP k={k}: drafts {stats.num_drafts}, draft tokens {stats.num_draft_tokens}, accepted "
        f"{stats.num_accepted_tokens} ({100 * stats.acceptance_rate:.1f}%), mean acceptance length "
        f"{stats.mean_acceptance_length:.2f}, accepted per position [{per_pos}]"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    if args.tensor_parallel_size < 1:
        raise SystemExit(
            f"atom-generate: --tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}"
        )
    model_dir = args.model if args.model is not None else default_model_dir()
    tok = _tokenizer(model_dir)
    engine_config = EngineConfig(
        num_speculative_tokens=args.speculative_tokens,
        max_num_seqs=max(1, len(args.prompt)),
        cuda_graphs=args.cuda_graphs,
        expert_parallel=args.expert_parallel,
    )
    prompts = [tok.encode(p).ids for p in args.prompt]
    params = [
        SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed + i,
            ignore_eos=args.ignore_eos,
        )
        for i in range(len(prompts))
    ]
    if args.tensor_parallel_size > 1:
        from atom_models.engine.tp_launch import TPRun, generate_tp

        device_type = torch.device(args.device).type
        print(f"tensor parallel: {args.tensor_parallel_size} ranks on {device_type}", file=sys.stderr)
        per_rank = generate_tp(
            model_dir,
            [TPRun(engine_config, prompts, params)],
            args.tensor_parallel_size,
            dtype=DTYPES[args.dtype],
            device_type=device_type,
            threads=args.threads,
        )
        results, elapsed = per_rank[0][0]  # every rank holds the same tokens (rank 0 decides sampled ones)
    else:
        engine = LLMEngine.from_pretrained(
            model_dir, engine_config, dtype=DTYPES[args.dtype], device=args.device
        )
        t0 = time.perf_counter()
        with tqdm(total=args.max_tokens * len(prompts), unit="tok", desc="generate", file=sys.stderr) as bar:
            results = engine.generate(prompts, params, progress=bar.update)
        elapsed = time.perf_counter() - t0
    total = SpecStats()
    for text, r in zip(args.prompt, results):
        total.merge(r.stats)
        print(f"--- prompt: {text!r}")
        print(text + tok.decode(r.output_ids))
        print(f"--- {len(r.output_ids)} tokens, {r.num_steps} target steps, finish: {r.finish_reason}")
    n = sum(len(r.output_ids) for r in results)
    print(f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s), dtype {args.dtype}")
    print(summary(total, args.speculative_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
