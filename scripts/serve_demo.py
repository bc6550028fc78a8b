"""Main job: serve the bundled tiny Qwen3-Next with MTP through vLLM (plugin mode), send a completion
through the OpenAI API, and print the spec-decode acceptance figures from the server's /metrics.

Usage: uv run python scripts/serve_demo.py [--model DIR] [--k 1] [--port 8011] [--dtype bfloat16]
Set ATOM_DISABLE_VLLM_PLUGIN=1 to run the same job on stock vLLM for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the server helper

from _server import ServerError, VllmServer, parse_metrics, per_label, spec_counters  # noqa: E402

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


# Triton's native module (nanobind) reports the objects still alive when a process that imported it exits:
# hundreds of lines per server process, no error. Nothing else the server writes is held back.
_NANOBIND_LEAK = re.compile(
    r"^(nanobind: leaked \d+ (instances|types|functions)!"
    r"|nanobind: this is likely caused by a reference counting issue"
    r"|See https://nanobind\.readthedocs\.io/en/latest/refleaks\.html"
    r"| - leaked (instance|type|function) "
    r"| - \.\.\. skipped remainder)"
)


class ServerOutput(threading.Thread):
    """Copies one output stream of the server to ours, line by line, without nanobind's leak report."""

    def __init__(self, src, dst) -> None:
        super().__init__(daemon=True)
        self.src, self.dst, self.dropped = src, dst, 0
        self.start()

    def run(self) -> None:
        for raw in iter(self.src.readline, b""):
            line = raw.decode(errors="replace")
            if _NANOBIND_LEAK.match(line):
                self.dropped += 1
                continue
            self.dst.write(line)
            self.dst.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: data/tiny-qwen3-next-mtp)")
    ap.add_argument("--k", type=int, default=1, help="num_speculative_tokens")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--startup-timeout", type=float, default=900, help="includes vLLM's torch.compile")
    ap.add_argument(
        "--enforce-eager", action="store_true", help="skip vLLM's compilation (default: compiled, as served)"
    )
    args = ap.parse_args()
    if args.model is None:
        from atom_core.paths import default_model_dir

        args.model = str(default_model_dir())

    server_args = [
        "--served-model-name", "tiny-qwen3-next", "--dtype", args.dtype, "--max-model-len", "2048",
        "--no-enable-prefix-caching", "--shutdown-timeout", "10",
        "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": args.k}),
    ] + (["--enforce-eager"] if args.enforce_eager else [])  # fmt: skip
    plugin = os.environ.get("ATOM_DISABLE_VLLM_PLUGIN", "0") != "1"
    server = VllmServer(
        args.model, server_args, plugin=plugin, port=args.port, env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        timeout=args.startup_timeout,
    )  # fmt: skip
    print("[main] starting:", " ".join(server.cmd), flush=True)
    relays: list[ServerOutput] = []
    try:
        try:
            server.start(on_spawn=lambda proc: relays.extend(
                [ServerOutput(proc.stdout, sys.stdout), ServerOutput(proc.stderr, sys.stderr)]
            ))  # fmt: skip
        except ServerError as e:
            print(f"[main] {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        t0 = time.time()
        body = {"model": "tiny-qwen3-next", "prompt": PROMPT, "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        resp = httpx.post(server.base + "/v1/completions", json=body, timeout=120).json()
        dt = time.time() - t0
        text = resp["choices"][0]["text"]
        n = resp["usage"]["completion_tokens"]
        metrics_text = server.metrics_text()
    finally:
        server.stop()
        for relay in relays:
            relay.join(timeout=30)
    dropped = sum(r.dropped for r in relays)
    if dropped:
        print(
            f"[main] server stopped ({dropped} lines of Triton's nanobind leak report at its exit not shown)"
        )
    # The result comes last, after the server's shutdown log.
    print("\n===== completion =====\n" + PROMPT + text + "\n======================")
    print(f"[main] {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)")
    counters = spec_counters(parse_metrics(metrics_text))
    drafts, draft_tokens, accepted = (
        counters["num_drafts"],
        counters["num_draft_tokens"],
        counters["num_accepted_tokens"],
    )
    by_pos = per_label(metrics_text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
    per_pos = [int(v) for _, v in sorted(by_pos.items(), key=lambda kv: int(kv[0]))]
    if not draft_tokens:
        print("[main] no speculative drafts were counted: MTP is not active", file=sys.stderr)
        return 1
    print(
        f"[main] MTP k={args.k}: drafts {int(drafts)}, draft tokens {int(draft_tokens)}, accepted {int(accepted)}, "
        f"acceptance rate {accepted / draft_tokens:.1%}, mean acceptance length {1 + accepted / drafts:.2f}, "
        f"per position {per_pos}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
