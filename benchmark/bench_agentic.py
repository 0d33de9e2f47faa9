"""Agentic sessions on the hierarchical prefix cache: many sessions x many turns over a long shared history, with a
device pool that holds about a quarter of their working set. Through the offline engine (CPU or GPU), three runs of
the same token sequences:

- `unbounded`: the prefix cache on a device pool that holds every session (the reference hit rate);
- `device`: the prefix cache on the small pool alone;
- `host`: the small pool with the host tier (--enable-hierarchical-cache, sized to hold the working set), and one
  more host run per other --io-backend / --write-policy given (named by what differs: `host-direct`, ...);
- `file` (with --storage-dir): the host tier of `host` over a file tier, on a fresh server whose directory a first
  server filled (the file tier after a restart).

    python benchmark/bench_agentic.py [--model-path tiny-deepseek-v4] [--device cpu] [--sessions 16] [--turns 4]
        [--system-tokens 384] [--turn-tokens 128] [--pool-fraction 0.25] [--storage-dir DIR]
        [--io-backend kernel direct] [--write-policy write_through write_back] [--out result.json]
    # on a GPU (Flash slice or full checkpoint; the same sizes as the prefix-cache run, scaled up):
    bash scripts/gpu_hicache.sh   # the Flash slice: 24 sessions x 5 turns, an 8192-token shared system prompt

The sessions are bench_prefix_cache.py's (run_sessions): every turn resends the whole conversation plus --turn-tokens
new tokens and generates one token (what TTFT measures); sessions are interleaved turn by turn, as concurrent agents
are, which is what makes a small pool evict each conversation's history before it comes back. Reported per run:
the prompt-token hit rate and its share per tier (device, host, file), the median TTFT, bytes moved between the
tiers; on CUDA also the host <-> device copy bandwidth of pinned memory, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import traceback
import statistics
import tempfile
import time

import torch
from bench_prefix_cache import run_sessions


def print_stacks(title: str) -> None:
    """Every thread's Python stack, taken under the GIL (faulthandler's unlocked dump can crash a busy process)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [title]
    for ident, frame in sys._current_frames().items():
        lines.append(f"--- thread {names.get(ident, ident)}")
        lines.extend(line.rstrip() for line in traceback.format_stack(frame))
    print("\n".join(lines), flush=True)


def working_set_tokens(args) -> int:
    return args.system_tokens + args.sessions * args.turns * (args.turn_tokens + 1)


def copy_bandwidth_gbps(device: str, nbytes: int = 256 << 20) -> dict:
    """Pinned host -> device and device -> host copy bandwidth (GB/s, 1e9), best of five."""
    if not device.startswith("cuda"):
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        out[name] = nbytes / best / 1e9
    return out


def run(args, name: str, pool_tokens: int, **engine_kwargs) -> dict:
    import sglang

    if args.dtype:
        engine_kwargs["dtype"] = args.dtype
    eng = sglang.Engine(model_path=args.model_path, device=args.device, log_level="warning",
                        max_total_tokens=pool_tokens, page_size=args.page_size, **engine_kwargs)
    tier = eng.model_runner.token_allocator.host_tier
    try:
        if args.device.startswith("cuda"):
            # The server's warm-up: every prefill launch variant compiled before the first timed turn (the offline
            # engine does not warm up by itself), so the first run's TTFT holds no compile.
            from sglang.srt.managers.server_warmup import run_server_warmup

            rep = run_server_warmup(eng.scheduler)
            if rep is not None:
                print(f"{name}: warm-up {rep.forwards} forwards in {rep.seconds:.1f} s", flush=True)
        start = time.perf_counter()
        # A run that stalls prints every thread's stack (the scheduler's, the copy engine's, the file tier's readers
        # and writers) once, so a benchmark cut off by its caller's time limit still says where it stood.
        watchdog = threading.Timer(args.stall_seconds, print_stacks, (f"{name}: no end after {args.stall_seconds} s",))
        watchdog.daemon = True
        watchdog.start()
        try:
            r = run_sessions(eng, args.sessions, args.turns, args.system_tokens, args.turn_tokens)
        finally:
            watchdog.cancel()
        stats = tier.stats if tier is not None else None
        print(f"{name}: {len(r.ttft)} turns in {time.perf_counter() - start:.1f} s", flush=True)
    finally:
        eng.shutdown()
    ttft, cached, prompt = r.ttft, r.cached_tokens, r.prompt_tokens
    host = stats.host_hit_tokens - stats.file_hit_tokens if stats else 0
    file = stats.file_hit_tokens if stats else 0
    return {"run": name, "pool_tokens": pool_tokens, "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt, "hit_rate_device": (cached - host - file) / prompt,
            "hit_rate_host": host / prompt, "hit_rate_file": file / prompt,
            "ttft_median_s": statistics.median(ttft), "ttft_mean_s": statistics.mean(ttft),
            "bytes_to_host": stats.bytes_to_host if stats else 0, "bytes_to_device": stats.bytes_to_device if stats
            else 0, "bytes_to_file": stats.bytes_to_file if stats else 0,
            "bytes_from_file": stats.bytes_from_file if stats else 0,
            "load_median_ms": statistics.median(stats.load_seconds) * 1e3 if stats and stats.load_seconds else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="tiny-deepseek-v4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", help="default: the engine's")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=384)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--pool-fraction", type=float, default=0.25, help="device pool / working set (small runs)")
    ap.add_argument("--host-ratio", type=float, default=6.0,
                    help="--hicache-ratio of the host run (x the small pool's pages and ends: every session)")
    ap.add_argument("--page-size", type=int, help="default: the engine's (256 for DeepSeek-V4)")
    ap.add_argument("--storage-dir", help="also run the file tier after a restart, in this directory")
    ap.add_argument("--stall-seconds", type=float, default=120.0,
                    help="print every thread's stack once if one engine's sessions take longer than this")
    ap.add_argument("--io-backend", nargs="+", default=["kernel"], choices=["kernel", "direct"],
                    help="--hicache-io-backend of the host runs (one host run per backend and write policy)")
    ap.add_argument("--write-policy", nargs="+", default=["write_through"],
                    choices=["write_through", "write_back", "write_through_selective"],
                    help="--hicache-write-policy of the host runs")
    ap.add_argument("--out")
    args = ap.parse_args()
    working = working_set_tokens(args)
    longest = args.system_tokens + args.turns * (args.turn_tokens + 1)
    small = max(int(working * args.pool_fraction), longest + 512)  # the longest turn, in flight, must fit
    bandwidth = copy_bandwidth_gbps(args.device)
    # A cached end (window tail and state slot) per session, beside the pages: the unbounded pool keeps one for every
    # session (2 state slots per running request, window slots for every token); the small pool a quarter of them
    unbounded = dict(max_running_requests=args.sessions, swa_full_tokens_ratio=1.0)
    small_ends = dict(max_running_requests=max(1, args.sessions // 8))
    hicache = dict(small_ends, enable_hierarchical_cache=True, hicache_ratio=args.host_ratio,
                   hicache_write_policy=args.write_policy[0], hicache_io_backend=args.io_backend[0])
    rows = [run(args, "unbounded", 2 * working, **unbounded), run(args, "device", small, **small_ends),
            run(args, "host", small, **hicache)]
    for io in args.io_backend:  # the other host runs, named by what differs from the first
        for policy in args.write_policy:
            if (io, policy) != (args.io_backend[0], args.write_policy[0]):
                name = "-".join(["host", *([io] if io != args.io_backend[0] else []),
                                 *([policy] if policy != args.write_policy[0] else [])])
                rows.append(run(args, name, small, **dict(hicache, hicache_io_backend=io,
                                                           hicache_write_policy=policy)))
    if args.storage_dir:
        extra = json.dumps({"storage_dir": args.storage_dir or tempfile.mkdtemp()})
        files = dict(hicache, hicache_storage_backend="file", hicache_storage_backend_extra_config=extra,
                     hicache_storage_prefetch_policy="wait_complete")
        run(args, "file-first-server", small, **files)
        rows.append(run(args, "file", small, **files))
    print(f"working set {working} tokens ({args.sessions} sessions x {args.turns} turns), small pool {small} tokens"
          + (f"; pinned copy bandwidth h2d {bandwidth['h2d']:.1f} GB/s, d2h {bandwidth['d2h']:.1f} GB/s"
             if bandwidth else ""))
    for r in rows:
        print(f"{r['run']:>15}: hit rate {r['hit_rate']:.3f} (device {r['hit_rate_device']:.3f}, host "
              f"{r['hit_rate_host']:.3f}, file {r['hit_rate_file']:.3f}); TTFT median {r['ttft_median_s'] * 1e3:7.1f} "
              f"ms, mean {r['ttft_mean_s'] * 1e3:7.1f} ms; to host {r['bytes_to_host'] / 2**20:.1f} MiB, to device "
              f"{r['bytes_to_device'] / 2**20:.1f} MiB, load median {r['load_median_ms']:.2f} ms", flush=True)
    ref, dev = rows[0], rows[1]
    for host in rows[2:]:
        print(f"{host['run']}: hit rate {host['hit_rate'] / ref['hit_rate']:.2f} of the unbounded pool's, median TTFT "
              f"{host['ttft_median_s'] / dev['ttft_median_s']:.2f}x the device-only cache's")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "working_set_tokens": working, "copy_bandwidth_gbps": bandwidth,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
