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
import signal
import subprocess
import sys
import threading
import time
import urllib.request

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def spec_metrics(metrics_text: str) -> dict[str, float]:
    """Sum the vllm:spec_decode_* counters of a Prometheus /metrics page."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if "_created" in line:
            continue
        m = re.match(r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m:
            key = m.group(1)
            if key.endswith("_per_pos"):
                pos = re.search(r'position="(\d+)"', m.group(2) or "")
                key = f"{key}[{pos.group(1) if pos else '?'}]"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


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

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", args.model, "--served-model-name", "tiny-qwen3-next",
        "--port", str(args.port), "--dtype", args.dtype, "--max-model-len", "2048",
        "--no-enable-prefix-caching", "--shutdown-timeout", "10",
        "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": args.k}),
    ] + (["--enforce-eager"] if args.enforce_eager else [])  # fmt: skip
    print("[main] starting:", " ".join(cmd), flush=True)
    server = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    relays = [
        ServerOutput(server.stdout, sys.stdout),
        ServerOutput(server.stderr, sys.stderr),
    ]
    base = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.time() + args.startup_timeout
        while True:
            if server.poll() is not None:
                print(f"[main] server exited with code {server.returncode} during start-up", file=sys.stderr)
                return 1
            try:
                _get(base + "/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    print("[main] server did not become healthy in time", file=sys.stderr)
                    return 1
                time.sleep(2)
        t0 = time.time()
        resp = _post(base + "/v1/completions", {
            "model": "tiny-qwen3-next", "prompt": PROMPT, "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True,
        })  # fmt: skip
        dt = time.time() - t0
        text = resp["choices"][0]["text"]
        n = resp["usage"]["completion_tokens"]
        m = spec_metrics(_get(base + "/metrics"))
    finally:
        _stop(server)
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
    drafts = m.get("vllm:spec_decode_num_drafts", 0.0)
    draft_tokens = m.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = m.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    per_pos = [int(v) for k, v in sorted(m.items()) if "per_pos" in k]
    if not draft_tokens:
        print("[main] no speculative drafts were counted: MTP is not active", file=sys.stderr)
        return 1
    print(
        f"[main] MTP k={args.k}: drafts {int(drafts)}, draft tokens {int(draft_tokens)}, accepted {int(accepted)}, "
        f"acceptance rate {accepted / draft_tokens:.1%}, mean acceptance length {1 + accepted / drafts:.2f}, "
        f"per position {per_pos}"
    )
    return 0


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
