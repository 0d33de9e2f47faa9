"""Shared pieces of the kernel benchmarks: CUDA-event timing, the copy-bandwidth ceiling, result rows.

Every kernel benchmark module exposes `bench() -> list[BenchRow]`; `run_all.py` measures the device copy
bandwidth once and reports each row's achieved bytes/s as a fraction of it (same run, same GPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch


@dataclass
class BenchRow:
    kernel: str
    case: str  # e.g. "bs=8 ctx=65536"
    time_us: float  # median
    bytes_moved: float  # bytes the kernel must read + write at minimum (the roofline numerator)
    flops: float = 0.0
    baseline_us: Optional[float] = None  # the torch reference on the same inputs, when measured
    note: str = ""

    def gbps(self) -> float:
        return self.bytes_moved / (self.time_us * 1e-6) / 1e9

    def to_dict(self, copy_gbps: float) -> dict:
        d = asdict(self)
        d["achieved_GBps"] = self.gbps()
        d["fraction_of_copy_bw"] = self.gbps() / copy_gbps
        return d


def time_cuda_us(fn: Callable[[], object], iters: int = 50, warmup: int = 5) -> float:
    """Median wall time of fn() in microseconds, by CUDA events (one event pair per call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbps(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    a = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    us = time_cuda_us(lambda: b.copy_(a), iters=20)
    del a, b
    return 2 * num_bytes / (us * 1e-6) / 1e9
