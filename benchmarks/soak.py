"""Soak test of vLLM's OpenAI server with MTP: the plugin and stock vLLM side by side, under hostile traffic.

For each implementation (atom: the plugin, float32; stock: ``ATOM_DISABLE_VLLM_PLUGIN=1``, bfloat16, which
stock's CPU GDN needs) one server is started with vLLM's default prefix-caching setting (and
``stock-no-prefix-caching``: stock with ``--no-enable-prefix-caching``, which stock vLLM-CPU needs to serve
at all). A set of greedy
requests is first sent one at a time (their single-request outputs). Then ``--concurrency`` clients keep
the server busy for ``--duration`` seconds with a random mix: greedy requests from that set (streamed or
not; each output is compared with its single-request output), sampled ones (temperature, top_p, top_k,
seeds; streamed or not), and streams the client drops after a few chunks (``--abort`` of all requests).
Reported per implementation: requests done / aborted, errors (HTTP or connection errors, wrong lengths, a
dead server), greedy requests checked and wrong, server RSS (process tree) at start and end and sampled
every ``--rss-every`` seconds under load (with the growth and the fitted slope over the second half, where a
leak would show once the caches have warmed), KV-cache usage and running requests after the load, ERROR
lines in the server log. Results go to
``benchmarks/results/soak.json``.

    uv run python benchmarks/soak.py                         # 600 s each, 256 clients, k = 3
    uv run python benchmarks/soak.py --impls stock-no-prefix-caching --append   # add one run to soak.json
    uv run python benchmarks/soak.py --impls atom --duration 60 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the server helper (tests/_server.py)

from _server import VllmServer  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DTYPE = {"atom": "float32", "stock": "bfloat16", "stock-no-prefix-caching": "bfloat16"}


def _rss_mib(pid: int) -> float:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20


def start_server(impl: str, model: str, k: int, log_path: Path) -> VllmServer:
    args = [
        "--served-model-name", "tiny", "--dtype", DTYPE[impl], "--enforce-eager", "--max-model-len", "512",
        "--max-num-seqs", "256", "--shutdown-timeout", "10",
        "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k}),
    ] + (["--no-enable-prefix-caching"] if impl == "stock-no-prefix-caching" else [])  # fmt: skip
    server = VllmServer(
        model, args, plugin=impl == "atom", log=log_path, env={"VLLM_CPU_KVCACHE_SPACE": "2"}, timeout=900
    )
    return server.start()


async def complete(
    client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int, stream: bool,
    sampling: dict[str, Any], abort_after: int | None = None,
) -> list[int] | None:  # fmt: skip
    """Generated token ids; None for a stream dropped by the client after ``abort_after`` chunks."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            "return_token_ids": True, "temperature": 0.0, **sampling}  # fmt: skip
    if not stream:
        r = await client.post(f"{base}/v1/completions", json=body)
        r.raise_for_status()
        return list(r.json()["choices"][0]["token_ids"])
    tokens: list[int] = []
    chunks = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                return None  # leaving the block closes the connection: vLLM aborts the request
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event in the stream: {event['error']}")
            for choice in event.get("choices", []):
                tokens.extend(choice.get("token_ids") or [])
    return tokens


def _greedy_set(prompts: list[list[int]], n: int, rng: random.Random) -> list[tuple[list[int], int]]:
    return [(prompts[i % len(prompts)][: rng.randint(8, 64)], rng.randint(8, 96)) for i in range(n)]


def _sampling(rng: random.Random) -> dict[str, Any]:
    s: dict[str, Any] = {"temperature": rng.choice([0.6, 0.8, 1.0, 1.2, 1.5])}
    if rng.random() < 0.5:
        s["top_p"] = rng.choice([0.8, 0.9, 0.95])
    if rng.random() < 0.3:
        s["top_k"] = rng.choice([1, 5, 20])
    if rng.random() < 0.3:
        s["seed"] = rng.randint(0, 2**31 - 1)
    return s


def rss_trend(samples: list[tuple[float, float]]) -> dict[str, float]:
    """Growth (MiB) and least-squares slope (MiB per minute) of ``(seconds, MiB)`` samples over their
    second half in time."""
    half = samples[-1][0] / 2
    tail = [(t, m) for t, m in samples if t >= half]
    if len(tail) < 2:
        return {}
    mean_t = sum(t for t, _ in tail) / len(tail)
    mean_m = sum(m for _, m in tail) / len(tail)
    var = sum((t - mean_t) ** 2 for t, _ in tail)
    slope = sum((t - mean_t) * (m - mean_m) for t, m in tail) / var if var else 0.0
    return {
        "rss_growth_second_half_mib": round(tail[-1][1] - tail[0][1], 1),
        "rss_slope_second_half_mib_per_min": round(slope * 60, 2),
    }


async def load(
    base: str, args, greedy: list[tuple[list[int], int]], refs: list[list[int]], prompts, pid: int
) -> dict:
    stats = {"done": 0, "aborted": 0, "greedy_checked": 0, "greedy_wrong": 0, "errors": 0}
    errors: list[str] = []
    wrong: list[dict[str, Any]] = []
    stop = time.time() + args.duration
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency)

    async def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            while time.time() < stop:
                roll = rng.random()
                stream = rng.random() < 0.5
                try:
                    if roll < args.abort:
                        p = prompts[rng.randrange(len(prompts))][: rng.randint(8, 64)]
                        await complete(
                            client, base, p, 256, True, _sampling(rng), abort_after=rng.randint(1, 4)
                        )
                        stats["aborted"] += 1
                    elif roll < args.abort + (1 - args.abort) / 2:
                        i = rng.randrange(len(greedy))
                        out = await complete(client, base, greedy[i][0], greedy[i][1], stream, {})
                        stats["done"] += 1
                        stats["greedy_checked"] += 1
                        if out != refs[i]:
                            stats["greedy_wrong"] += 1
                            first = next(
                                (t for t, (a, b) in enumerate(zip(out, refs[i])) if a != b), len(out)
                            )
                            wrong.append({"case": i, "first_wrong_token": first, "len": len(out)})
                    else:
                        p = prompts[rng.randrange(len(prompts))][: rng.randint(8, 64)]
                        n = rng.randint(8, 128)
                        out = await complete(client, base, p, n, stream, _sampling(rng))
                        if len(out) != n:
                            raise RuntimeError(f"{len(out)} tokens, expected {n}")
                        stats["done"] += 1
                except Exception as e:  # every failure is counted and kept
                    stats["errors"] += 1
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                    if not await _healthy(client, base):
                        stats["server_died_after_s"] = round(time.time() - (stop - args.duration), 1)
                        return  # the server is gone: every client stops
                    await asyncio.sleep(1)

    rss: list[tuple[float, float]] = []

    async def rss_sampler() -> None:
        t0 = time.time()
        while True:
            rss.append((round(time.time() - t0, 1), round(_rss_mib(pid), 1)))
            if time.time() >= stop:
                return
            await asyncio.sleep(min(args.rss_every, max(stop - time.time(), 0.0)))

    await asyncio.gather(rss_sampler(), *(client_loop(1000 + c) for c in range(args.concurrency)))
    return {
        **stats, "rss_mib_samples": rss, **rss_trend(rss), "first_errors": errors[:20],
        "first_wrong_greedy": wrong[:20],
    }  # fmt: skip


def soak(impl: str, args, prompts: list[list[int]], workdir: Path) -> dict[str, Any]:
    log_path = workdir / f"soak_{impl}.log"
    server = start_server(impl, args.model, args.k, log_path)
    base, pid = server.base, server.proc.pid
    try:
        rng = random.Random(0)
        greedy = _greedy_set(prompts, args.greedy_set, rng)
        refs = [
            asyncio.run(_one(base, p, n)) for p, n in greedy
        ]  # single-request outputs, one request at a time
        rss_start = _rss_mib(pid)
        t0 = time.time()
        result = asyncio.run(load(base, args, greedy, refs, prompts, pid))
        wall = time.time() - t0
        deadline = time.time() + 120
        while "server_died_after_s" not in result and time.time() < deadline:
            if server.metric("vllm:num_requests_running") == 0:
                break
            time.sleep(1)
        healthy = asyncio.run(_health_once(base))
        result.update(
            impl=impl, dtype=DTYPE[impl], k=args.k, concurrency=args.concurrency, duration_s=round(wall, 1),
            healthy_at_end=healthy, rss_mib_start=round(rss_start, 1),
        )  # fmt: skip
        if healthy:
            result.update(
                rss_mib_end=round(_rss_mib(pid), 1),
                running_at_end=server.metric("vllm:num_requests_running"),
                kv_cache_usage_at_end=server.metric("vllm:kv_cache_usage_perc"),
            )
    except Exception as e:
        result = {"impl": impl, "fatal": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        server.stop()
    result.update(log_summary(log_path))
    return result


def log_summary(log_path: Path) -> dict[str, Any]:
    """ERROR lines of a server log, split at vLLM's first "[shutdown]" line: vLLM 0.32's API server logs
    an ``EngineDeadError`` traceback while it shuts down after SIGTERM, which is not a serving error."""
    lines = log_path.read_text(errors="replace").splitlines()
    cut = next((i for i, ln in enumerate(lines) if "[shutdown]" in ln), len(lines))
    err = [ln for ln in lines[:cut] if re.search(r"\bERROR\b", ln)]
    at_shutdown = [ln for ln in lines[cut:] if re.search(r"\bERROR\b", ln)]
    return {
        "error_log_lines": len(err), "error_log_lines_at_shutdown": len(at_shutdown),
        "first_error_log_lines": err[:10], "log": str(log_path),
    }  # fmt: skip


async def _healthy(client: httpx.AsyncClient, base: str) -> bool:
    try:
        return (await client.get(f"{base}/health", timeout=30)).status_code == 200
    except httpx.HTTPError:
        return False


async def _health_once(base: str) -> bool:
    async with httpx.AsyncClient() as client:
        return await _healthy(client, base)


async def _one(base: str, prompt: list[int], n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=600) as client:
        return await complete(client, base, prompt, n, False, {})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bundled tiny model)")
    ap.add_argument(
        "--impls", nargs="+", default=["atom", "stock", "stock-no-prefix-caching"], choices=list(DTYPE)
    )
    ap.add_argument("--duration", type=float, default=600, help="seconds of load per implementation")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--abort", type=float, default=0.2, help="fraction of requests the client drops")
    ap.add_argument("--greedy-set", type=int, default=32, help="distinct greedy requests checked")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--rss-every", type=float, default=30, help="seconds between server RSS samples")
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    ap.add_argument("--append", action="store_true", help="keep the other implementations' runs in --out")
    args = ap.parse_args()
    if args.model is None:
        from atom_core.paths import default_model_dir

        args.model = str(default_model_dir())
    from atom_core.paths import reference_dir

    raw = json.loads((reference_dir() / "prompts.json").read_text())
    prompts = [p["prompt_token_ids"] for p in raw["prompts"]]
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / "atom-soak"
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    kept = json.loads(out.read_text())["runs"] if args.append and out.is_file() else []
    runs = []
    for impl in args.impls:
        print(f"[soak] {impl}: {args.duration:.0f} s, {args.concurrency} clients, k={args.k}", flush=True)
        runs.append({**soak(impl, args, prompts, workdir), "command": " ".join(sys.argv)})
        print(
            json.dumps(
                {k: v for k, v in runs[-1].items() if not k.startswith("first_") and k != "rss_mib_samples"},
                indent=1,
            ),
            flush=True,
        )
    runs = [r for r in kept if r["impl"] not in args.impls] + runs
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(f"[soak] wrote {args.out}")
    bad = [
        r
        for r in runs
        if r["impl"] == "atom" and (r.get("fatal") or r.get("errors") or r.get("greedy_wrong"))
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
