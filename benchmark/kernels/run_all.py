"""Run every kernel benchmark in one GPU process: the two ceilings first (copy bandwidth, bf16 matmul rate), then
each kernel's rows as fractions of them (bytes/s of the copy bandwidth; flop/s of the matmul rate where the row
counts flops: the sparse attention and indexer logits, whose tensor-core work per byte is near or above the ridge).

    python benchmark/kernels/run_all.py [--out results.json] [--only sparse_attention indexer ...]
    python benchmark/kernels/run_all.py --only none      # a name no benchmark has: the two limits alone

Writes a markdown table to stdout (paste into benchmark/RESULTS.md) and all rows as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import copy_bandwidth_gbps, matmul_tflops  # noqa: E402

MODULES = ["bench_dsv4_store_kv", "bench_dsv4_sparse_attention", "bench_dsv4_compress", "bench_dsv4_indexer"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*", help="substrings of module names to run")
    args = ap.parse_args()
    copy = copy_bandwidth_gbps()
    mm = matmul_tflops()
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, torch {torch.__version__}, copy bandwidth {copy:.0f} GB/s (read + write), bf16 matmul "
          f"{mm:.0f} TFLOP/s (8192^3), {time.strftime('%Y-%m-%d')}\n")
    from common import time_eager_us

    empty = torch.empty(1, device="cuda")
    launch = time_eager_us(lambda: empty.add_(1))
    print(f"Times are GPU kernel times from the CUDA profiler (host launch excluded, as under CUDA graphs); an "
          f"eager torch launch costs {launch:.1f} us of wall time here.\n")
    print("| kernel | case | time us | GB/s | fraction of copy bw | TFLOP/s | fraction of matmul | torch ref us "
          "| note |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in MODULES:
        if args.only and not any(o in name for o in args.only):
            continue
        try:
            module = importlib.import_module(name)
            results = module.bench()
        except Exception as e:  # one broken benchmark must not hide the others
            print(f"| {name} | FAILED | | | | | | | {type(e).__name__}: {e} |")
            continue
        for r in results:
            d = r.to_dict(copy)
            tf = r.flops / (r.time_us * 1e-6) / 1e12
            d["achieved_TFLOPs"], d["fraction_of_matmul"] = tf, tf / mm
            rows.append(d)
            base = f"{r.baseline_us:.1f}" if r.baseline_us else ""
            flops = f"{tf:.0f} | {tf / mm:.2f}" if r.flops else " | "
            print(f"| {r.kernel} | {r.case} | {r.time_us:.1f} | {d['achieved_GBps']:.0f} | "
                  f"{d['fraction_of_copy_bw']:.2f} | {flops} | {base} | {r.note} |")
        sys.stdout.flush()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu, "copy_GBps": copy, "matmul_TFLOPs": mm, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
