"""The physical floor of a decode MoE's reads at their real size: how fast an H200 streams the bytes the fused MXFP4 MoE
reads at 1 / 8 / 32 tokens (the touched experts' packed gate-up and down weights), by kernels that do nothing but read,
replayed from a CUDA graph as the engine replays decode.

    python benchmark/kernels/read_floor.py [--touched 6 43 140]

Per touched-expert count: one read kernel over all the bytes, and the MoE's kernel chain with its compute taken out
(a one-program kernel, a read of the gate-up bytes, a read of the down bytes, a one-program kernel: the align, the two
GEMMs and the combine). Each read is the best of a few tile shapes. The large-copy bandwidth (2 x 2 GiB, the ratio the
MoE benchmarks report) is measured in the same run: a read of 20-80 MB does not reach it (launch, ramp-up, tail), so
`fraction_of_copy_bw` of the chain is the ceiling a MoE of that size can show.
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

# packed bytes per Flash expert (D 4096, I 2048): codes + one scale byte per 32 weights
GATE_UP_BYTES = 2 * 2048 * 4096 // 2 + 2 * 2048 * 4096 // 32
DOWN_BYTES = 4096 * 2048 // 2 + 4096 * 2048 // 32


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """XOR of ITERS consecutive BLOCK-word tiles (one store per program: nothing the compiler can drop)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.int32)
    for it in range(ITERS):
        offs = base + it * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


@triton.jit
def _one_program_kernel(out_ptr):
    tl.store(out_ptr, tl.load(out_ptr) + 1)


def reader(words: torch.Tensor, block: int, iters: int, warps: int):
    out = torch.empty(triton.cdiv(words.numel(), block * iters), dtype=torch.int32, device=words.device)
    return lambda: _read_kernel[(out.numel(),)](words, out, words.numel(), BLOCK=block, ITERS=iters, num_warps=warps)


def best_reader(words: torch.Tensor):
    """The fastest of a few read tilings (graph-replayed) and its time in ms."""
    timed = []
    for block, iters, warps in ((1024, 4, 4), (2048, 4, 8), (2048, 8, 8), (4096, 4, 8), (1024, 16, 4)):
        fn = reader(words, block, iters, warps)
        timed.append((triton.testing.do_bench_cudagraph(fn, rep=100), fn))
    return min(timed, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--touched", type=int, nargs="+", default=[6, 43, 140])
    args = ap.parse_args()
    bw = copy_bandwidth_gbps() * 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (2 x 2 GiB)", flush=True)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    tiny = lambda: _one_program_kernel[(1,)](flag)  # noqa: E731
    for n in args.touched:
        floor_ms = n * (GATE_UP_BYTES + DOWN_BYTES) / bw * 1e3
        # four copies of the bytes read in turn (320+ MB, past the 50 MB L2: cold, as a layer's experts are in the
        # engine) and one copy read again and again (the MoE benchmarks' case: at 1 token part of it stays in L2)
        sets = [(torch.randint(-2**31, 2**31 - 1, (n * GATE_UP_BYTES // 4,), dtype=torch.int32, device="cuda"),
                 torch.randint(-2**31, 2**31 - 1, (n * DOWN_BYTES // 4,), dtype=torch.int32, device="cuda"))
                for _ in range(4)]
        one_ms, _ = best_reader(torch.cat(sets[0]))
        readers = [(best_reader(gate)[1], best_reader(down)[1]) for gate, down in sets]

        def chain(copies):
            def run():
                for gate_fn, down_fn in readers[:copies]:
                    tiny()
                    gate_fn()
                    down_fn()
                    tiny()
            return run

        hot_ms = triton.testing.do_bench_cudagraph(chain(1), rep=100)
        cold_ms = triton.testing.do_bench_cudagraph(chain(4), rep=100) / 4
        print(f"{n:4d} experts ({n * (GATE_UP_BYTES + DOWN_BYTES) / 1e6:.1f} MB, floor {floor_ms * 1e3:.1f} us): "
              f"one read kernel {one_ms * 1e3:.1f} us ({floor_ms / one_ms:.2f} of copy bw) | the MoE's chain without "
              f"its compute (tiny, gate-up bytes, down bytes, tiny) {hot_ms * 1e3:.1f} us ({floor_ms / hot_ms:.2f}), "
              f"cold {cold_ms * 1e3:.1f} us ({floor_ms / cold_ms:.2f})", flush=True)



if __name__ == "__main__":
    main()
