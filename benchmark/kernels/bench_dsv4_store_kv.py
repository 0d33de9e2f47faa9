"""Benchmark of dsv4_store_kv (window / compressed KV entries written by slot) on DeepSeek-V4-Flash rows.

Cases: 1, 16, 256, 4096 rows of D = 512 bf16 values into an FP8 cache (584 B rows, rope 64) and a bf16 cache,
at random slots of a 64K-row pool. bytes_moved = values read (bf16) + slots read (int64) + rows written.
`baseline_us` = the torch reference (quantize + index_copy_) on the same inputs.
"""

from __future__ import annotations

import os
import sys

import torch

from sgl_kernel.dsv4_store_kv import dsv4_store_kv, dsv4_store_kv_ref, fp8_kv_row_bytes

try:
    from .common import BenchRow, time_cuda_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import BenchRow, time_cuda_us

D, ROPE, POOL = 512, 64, 1 << 16
ROWS = (1, 16, 256, 4096)


def _row(n: int, fp8: bool) -> BenchRow:
    rope = ROPE if fp8 else 0
    width = fp8_kv_row_bytes(D, ROPE) if fp8 else D
    cache = torch.zeros(POOL, width, dtype=torch.uint8 if fp8 else torch.bfloat16, device="cuda")
    slots = torch.randperm(POOL, device="cuda")[:n]
    values = torch.randn(n, D, dtype=torch.bfloat16, device="cuda")
    us = time_cuda_us(lambda: dsv4_store_kv(cache, slots, values, fp8_rope_dim=rope))
    base = time_cuda_us(lambda: dsv4_store_kv_ref(cache, slots, values, fp8_rope_dim=rope), iters=20)
    row_bytes = width * cache.element_size()
    return BenchRow(kernel="dsv4_store_kv", case=f"n={n} {'fp8' if fp8 else 'bf16'}", time_us=us,
                    bytes_moved=n * (2 * D + 8 + row_bytes), baseline_us=base)


def bench() -> list:
    return [_row(n, fp8) for fp8 in (True, False) for n in ROWS]


if __name__ == "__main__":
    for r in bench():
        print(f"{r.case:12s} {r.time_us:8.1f} us {r.gbps():7.0f} GB/s  ref {r.baseline_us:8.1f} us")
