"""Multi-turn chat sessions through sglang-router over two replicas: cache-aware routing against round robin, by the
replicas' prefix-cache hit rate and the throughput (CPU with the tiny model, or GPUs).

    python benchmark/bench_router.py [--model-path tiny-deepseek-v4] [--server-args "--device cpu"]
        [--users 8] [--turns 5] [--system-words 200] [--turn-words 60] [--max-tokens 8]
        [--policies cache_aware round_robin] [--system-per-user] [--worker-urls URL URL] [--out result.json]

Each user's session opens with a system prompt all users share (each their own with --system-per-user) plus the
user's own first message; every later turn
resends the whole conversation (the assistant's replies included) plus --turn-words new words, as a chat client does.
The users run at once, each turn after the previous one's answer. For each policy the replicas' prefix caches are
flushed, a router is started in front of them (`python -m sglang_router.launch_router --policy P`) and the same
sessions run. The hit rate is what the replicas report per request (usage.prompt_tokens_details.cached_tokens over
usage.prompt_tokens, summed over every turn); the replicas' own /metrics gauge `sglang:cache_hit_rate` counts since
their start, so it is printed for reference only; each replica's share of the requests is the difference of its
`sglang:num_requests_total`. Without --worker-urls the two replicas are started here with
--server-args (on one GPU each: pass e.g. "--base-gpu-id" through two separate launches and --worker-urls instead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(url: str, proc: subprocess.Popen, log: str, timeout: float, ok=lambda r: r.status_code == 200) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2]} exited with {proc.returncode}; its log: {log}")
        try:
            if ok(httpx.get(url, timeout=2)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s; log: {log}")


def start(module: str, args: list, log_dir: str, name: str) -> tuple:
    log = os.path.join(log_dir, f"{name}.log")
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, log


def start_replicas(args, log_dir: str) -> tuple:
    procs, urls = [], []
    for i in range(2):
        port = free_port()
        proc, log = start("sglang.launch_server", ["--model-path", args.model_path, "--host", "127.0.0.1", "--port",
                                                   str(port), "--enable-metrics", *shlex.split(args.server_args)],
                          log_dir, f"replica{i}")
        procs.append((proc, log))
        urls.append(f"http://127.0.0.1:{port}")
    for (proc, log), url in zip(procs, urls):
        wait_until(f"{url}/health", proc, log, args.startup_timeout)
    return [p for p, _ in procs], urls


def sessions(args) -> tuple:
    """Each user's system prompt and turns (words drawn from a fixed seed, so every policy sees the same
    conversations)."""
    rng = random.Random(0)
    vocab = [f"{rng.choice('bcdfghjklmnprstvz')}{rng.choice('aeiou')}{rng.choice('lmnrst')}" for _ in range(500)]
    words = lambda n: " ".join(rng.choice(vocab) for _ in range(n))  # noqa: E731
    shared = "You are a careful assistant. " + words(args.system_words)
    systems = [shared if not args.system_per_user else f"You are assistant {u}. " + words(args.system_words)
               for u in range(args.users)]
    return systems, [[words(args.turn_words) for _ in range(args.turns)] for _ in range(args.users)]


async def run_sessions(router_url: str, args, systems: list, users: list) -> dict:
    totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}

    async def user(client: httpx.AsyncClient, system: str, turns: list) -> None:
        messages = [{"role": "system", "content": system}]
        for text in turns:
            messages.append({"role": "user", "content": text})
            r = await client.post(f"{router_url}/v1/chat/completions", json={
                "model": args.model_path, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0})
            r.raise_for_status()
            out = r.json()
            messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""})
            usage = out["usage"]
            totals["requests"] += 1
            totals["prompt_tokens"] += usage["prompt_tokens"]
            totals["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            totals["completion_tokens"] += usage["completion_tokens"]

    begin = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(user(client, system, turns) for system, turns in zip(systems, users)))
    wall = time.perf_counter() - begin
    return {**totals, "wall_s": round(wall, 2), "hit_rate": round(totals["cached_tokens"] / totals["prompt_tokens"], 4),
            "requests_per_s": round(totals["requests"] / wall, 3),
            "output_tokens_per_s": round(totals["completion_tokens"] / wall, 2),
            "prompt_tokens_per_s": round(totals["prompt_tokens"] / wall, 1)}


def replica_metric(url: str, name: str) -> float:
    found = re.search(rf"{name}\{{[^}}]*\}} ([0-9.e+-]+)", httpx.get(f"{url}/metrics", timeout=10).text)
    return float(found.group(1)) if found else 0.0  # a labelled family without a sample: nothing counted yet


def bench_policy(policy: str, urls: list, args, log_dir: str) -> dict:
    for url in urls:  # each policy starts from empty caches
        httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()
    port = free_port()
    proc, log = start("sglang_router.launch_router", [
        "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn",
        "--policy", policy, "--worker-urls", *urls], log_dir, f"router-{policy}")
    try:
        router = f"http://127.0.0.1:{port}"
        wait_until(f"{router}/readiness", proc, log, 60, ok=lambda r: r.status_code == 200
                   and r.json().get("healthy_workers") == len(urls))
        served = [replica_metric(u, "sglang:num_requests_total") for u in urls]
        systems, users = sessions(args)
        result = asyncio.run(run_sessions(router, args, systems, users))
        served = [int(replica_metric(u, "sglang:num_requests_total") - n) for u, n in zip(urls, served)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"policy": policy, **result, "requests_per_replica": served,
            "replica_cache_hit_rate_since_start": [replica_metric(u, "sglang:cache_hit_rate") for u in urls]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="tiny-deepseek-v4")
    ap.add_argument("--server-args", default="--device cpu", help="flags of both replicas' launch_server")
    ap.add_argument("--worker-urls", nargs=2, help="two running replicas (then none is started here)")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=200)
    ap.add_argument("--turn-words", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--system-per-user", action="store_true", help="each user its own system prompt (no shared one)")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--out")
    args = ap.parse_args()

    log_dir = tempfile.mkdtemp(prefix="bench_router_")
    procs, urls = ([], args.worker_urls) if args.worker_urls else start_replicas(args, log_dir)
    try:
        results = [bench_policy(p, urls, args, log_dir) for p in args.policies]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    print(f"{args.users} users x {args.turns} turns, 2 replicas ({args.model_path}, {args.server_args}); logs in "
          f"{log_dir}")
    print("| policy | prefix-cache hit rate | prompt tokens | cached tokens | requests per replica | requests/s | "
          "output tok/s | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['prompt_tokens']} | {r['cached_tokens']} | "
              f"{' / '.join(map(str, r['requests_per_replica']))} | {r['requests_per_s']} | "
              f"{r['output_tokens_per_s']} | {r['wall_s']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
