"""The fused MoE's token sort (sgl_kernel.dsv4_moe_align) on a GPU: the one-program Triton sort against the torch
ops, as CUDA-graph replays (the engine's decode replays graphs), at Flash's 256 experts, top-6, with one other rank's
pair (-1) per batch; both checked equal first. The crossover sets ALIGN_ONE_PROGRAM_PAIRS.

    python benchmark/kernels/bench_moe_align.py [--tokens 1 8 32 42 128 256 1024 4096]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton


def main() -> None:
    from sgl_kernel.dsv4_moe_align import dsv4_moe_align

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 42, 128, 256, 1024, 4096])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--block-m", type=int, default=16)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    e, k, bm = args.experts, args.top_k, args.block_m
    for t in args.tokens:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        ids[0, 0] = -1
        start = time.time()
        one = dsv4_moe_align(ids, e, bm, one_program=True)
        first_s = time.time() - start  # the compile, once per power-of-two pair count
        ops = dsv4_moe_align(ids, e, bm, one_program=False)
        if not all(torch.equal(a, b) for a, b in zip(one, ops)):
            raise SystemExit(f"tokens {t}: the one-program sort differs from the torch ops")
        us_one = triton.testing.do_bench_cudagraph(lambda: dsv4_moe_align(ids, e, bm, one_program=True), rep=100) * 1e3
        us_ops = triton.testing.do_bench_cudagraph(lambda: dsv4_moe_align(ids, e, bm, one_program=False), rep=100) * 1e3
        print(f"tokens {t:5d} pairs {t * k:6d}: one program {us_one:8.1f} us (first call {first_s:.1f} s) | torch ops "
              f"{us_ops:6.1f} us | equal", flush=True)


if __name__ == "__main__":
    main()
