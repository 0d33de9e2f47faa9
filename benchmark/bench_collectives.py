"""The collectives tensor / expert / DP-attention parallelism issues, at the engine's message sizes, between the GPUs
of one host, as a fraction of the peer-to-peer copy bandwidth measured in the same run (the physical limit
RESULTS.md holds them to).

    python benchmark/bench_collectives.py                        # 2 GPUs, hidden 4096, rows 1 32 128 8192
    python benchmark/bench_collectives.py --world 4 --rows 1 128
    python benchmark/bench_collectives.py --device cpu --rows 1 32   # gloo dry run (no bandwidth figures)

Per row count: all_reduce of bf16 [rows, hidden] (TP's output projections and MoE sums, the vocabulary-parallel
embedding) and all_gather of the same (DP attention's exchange), each issued `--iters` times back to back after a
warm-up and timed with CUDA events on rank 0 (prefill issues them eagerly like this; decode replays them in graphs,
where the launch cost is gone). Bus bandwidth follows NCCL's convention: bytes x 2 (n - 1) / n / time for all_reduce,
bytes x (n - 1) / n / time for all_gather (bytes: the gathered result). The limit: a 256 MiB copy from GPU 0 to GPU 1
(one direction over NVLink or PCIe).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def peer_copy_gbps(iters: int = 10) -> float:
    """GB/s of a 256 MiB copy from cuda:0 to cuda:1 (run on rank 0 before the ranks meet)."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    return src.numel() * iters / (time.perf_counter() - start) / 1e9


def time_ms(fn, iters: int, device: torch.device) -> float:
    """Mean ms per call of `iters` back-to-back calls (CUDA events on a GPU, wall time on CPU), after 5 warm-ups."""
    for _ in range(5):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / iters


def rank_main(rank: int, args, port: int, queue) -> None:
    on_gpu = args.device == "cuda"
    device = torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    limit = peer_copy_gbps() if on_gpu and rank == 0 else None
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world)
    n, rows_out = args.world, []
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, device=device, dtype=torch.bfloat16)
        gathered = torch.empty(n * rows, args.hidden, device=device, dtype=torch.bfloat16)
        ar_ms = time_ms(lambda: dist.all_reduce(x), args.iters, device)
        ag_ms = time_ms(lambda: dist.all_gather_into_tensor(gathered, x), args.iters, device)
        nbytes = x.numel() * x.element_size()
        row = {"rows": rows, "hidden": args.hidden, "world": n, "bytes": nbytes, "all_reduce_us": ar_ms * 1e3,
               "all_gather_us": ag_ms * 1e3,
               "all_reduce_bus_gbps": nbytes * 2 * (n - 1) / n / (ar_ms * 1e-3) / 1e9,
               "all_gather_bus_gbps": nbytes * n * (n - 1) / n / (ag_ms * 1e-3) / 1e9,
               "peer_copy_gbps": limit}
        if limit:
            row["all_reduce_fraction"] = row["all_reduce_bus_gbps"] / limit
            row["all_gather_fraction"] = row["all_gather_bus_gbps"] / limit
        rows_out.append(row)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows_out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 8192])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--world {args.world} needs {args.world} GPUs; {torch.cuda.device_count()} here")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    for r in rows:
        frac = (f" | {r['all_reduce_fraction']:.2f} / {r['all_gather_fraction']:.2f} of the "
                f"{r['peer_copy_gbps']:.0f} GB/s peer copy" if r["peer_copy_gbps"] else "")
        print(f"rows {r['rows']:5d} x {r['hidden']} bf16 ({r['bytes'] / 2**20:8.3f} MiB) | all_reduce "
              f"{r['all_reduce_us']:9.1f} us {r['all_reduce_bus_gbps']:7.1f} GB/s bus | all_gather "
              f"{r['all_gather_us']:9.1f} us {r['all_gather_bus_gbps']:7.1f} GB/s bus{frac}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
