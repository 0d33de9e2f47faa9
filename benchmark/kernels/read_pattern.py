"""Does the decode MoE's read pattern, not its compute, cost bandwidth? The gate-up kernel of the fused MXFP4 MoE reads,
per program and K step, a [BLOCK_N, BLOCK_K / 2]-byte tile of an expert's gate rows and one of its up rows: 64-128
bytes from each of 256 rows 2 KB apart (Flash: D 4096), the K splits of one tile at once. This times kernels that do
only those reads (XOR of the words, one store per program) at the touched-expert counts of 1 and 8 tokens, against the
same programs reading the same bytes stored tile by tile (each K step's tile one contiguous chunk), and a plain
contiguous read of the touched bytes; graph replays, copy bandwidth of the same run.

    python benchmark/kernels/read_pattern.py [--touched 6 43]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbps  # noqa: E402
from read_floor import best_reader  # noqa: E402

E, D, I = 256, 4096, 2048
KW = D // 8  # int32 words of codes per row


@triton.jit
def _rows_kernel(w_ptr, ids_ptr, out_ptr, KW_PER_SPLIT, I: tl.constexpr, KW: tl.constexpr, BN: tl.constexpr,
                 BKW: tl.constexpr):
    e = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    base = w_ptr + e * (2 * I * KW)
    k_lo = tl.program_id(2) * KW_PER_SPLIT
    acc = tl.zeros([BN, BKW], tl.int32)
    for k in range(k_lo, k_lo + KW_PER_SPLIT, BKW):
        cols = k + tl.arange(0, BKW)[None, :]
        acc ^= tl.load(base + n[:, None] * KW + cols) ^ tl.load(base + (I + n)[:, None] * KW + cols)
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    tl.store(out_ptr + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0))


@triton.jit
def _tiles_kernel(w_ptr, ids_ptr, out_ptr, KT_PER_SPLIT, I: tl.constexpr, KW: tl.constexpr, BN: tl.constexpr,
                  BKW: tl.constexpr):
    """The same bytes as [E, 2, I / BN, KW / BKW, BN * BKW]: each (half, row tile, K tile) one contiguous chunk."""
    e = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    NT: tl.constexpr = I // BN
    KT: tl.constexpr = KW // BKW
    CH: tl.constexpr = BN * BKW
    base = w_ptr + e * (2 * I * KW)
    k_lo = tl.program_id(2) * KT_PER_SPLIT
    acc = tl.zeros([CH], tl.int32)
    for kt in range(k_lo, k_lo + KT_PER_SPLIT):
        g = base + (tl.program_id(1) * KT + kt) * CH + tl.arange(0, CH)
        acc ^= tl.load(g) ^ tl.load(g + NT * KT * CH)
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--touched", type=int, nargs="+", default=[6, 43])
    args = ap.parse_args()
    bw = copy_bandwidth_gbps() * 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    w = torch.randint(-2**31, 2**31 - 1, (E, 2 * I, KW), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in args.touched:
        ids = torch.randperm(E, device="cuda", generator=g)[:n].contiguous()
        nbytes = n * 2 * I * KW * 4
        floor_us = nbytes / bw * 1e6
        contiguous_ms, _ = best_reader(w[ids].flatten())
        row = [f"{n} experts ({nbytes / 1e6:.1f} MB codes, floor {floor_us:.1f} us): contiguous read "
               f"{contiguous_ms * 1e3:.1f} us ({floor_us / contiguous_ms / 1e3:.2f})"]
        for bn, bk, splits, warps, stages in ((128, 128, 4, 4, 3), (128, 256, 2, 4, 3), (128, 256, 1, 4, 3),
                                              (64, 256, 1, 2, 3), (128, 128, 4, 4, 1), (128, 256, 4, 8, 3)):
            bkw = bk // 8
            out = torch.empty(n * (I // bn) * splits, dtype=torch.int32, device="cuda")
            grid = (n, I // bn, splits)
            rows = lambda: _rows_kernel[grid](w, ids, out, KW // splits, I=I, KW=KW, BN=bn, BKW=bkw,  # noqa: E731
                                              num_warps=warps, num_stages=stages)
            tiles = lambda: _tiles_kernel[grid](w, ids, out, KW // bkw // splits, I=I, KW=KW, BN=bn,  # noqa: E731
                                                BKW=bkw, num_warps=warps, num_stages=stages)
            r_us = triton.testing.do_bench_cudagraph(rows, rep=100) * 1e3
            t_us = triton.testing.do_bench_cudagraph(tiles, rep=100) * 1e3
            row.append(f"{bn}x{bk} split {splits} w{warps} s{stages}: rows {r_us:.1f} us ({floor_us / r_us:.2f}), "
                       f"tiles {t_us:.1f} us ({floor_us / t_us:.2f})")
        print("\n  ".join(row), flush=True)


if __name__ == "__main__":
    main()
