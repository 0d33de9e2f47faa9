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


def time_eager_us(fn: Callable[[], object], iters: int = 50, warmup: int = 5) -> float:
    """Median wall time of fn() in microseconds by CUDA events around each eager call. For small kernels this is the
    host launch path (Python + Triton launcher), not the GPU."""
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


def kernel_times_us(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> dict:
    """GPU time of each kernel (or memcpy) one fn() call launches, by name, in microseconds: device times from the
    CUDA profiler (CUPTI), averaged over `iters` calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:  # a kernel or memcpy on the GPU
            times[event.name] = times.get(event.name, 0.0) + event.time_range.elapsed_us() / iters
    return times


def time_cuda_us(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """GPU time of one fn() call in microseconds: the sum of the device times of every kernel it launches
    (kernel_times_us). Host launch overhead and gaps are excluded, as they are when serving under CUDA graphs;
    `time_eager_us` gives the wall time with launches."""
    total = sum(kernel_times_us(fn, iters, warmup).values())
    return total if total > 0 else time_eager_us(fn, iters=iters, warmup=0)


def copy_bandwidth_gbps(num_elements: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth of two 2 GiB bf16 buffers (as the HF peer script, hf_peer.py, measures it),
    counting bytes read plus bytes written: the engine's own measurement (bench_one_batch's bytes floor uses it)."""
    from sglang.srt.utils.bytes_floor import copy_bandwidth_gbps as measure

    return measure(torch.device("cuda"), 2 * num_elements)


def matmul_tflops(n: int = 8192) -> float:
    """bf16 [n, n] x [n, n] rate on random data (the tensor-core ceiling of compute-bound kernels)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    us = time_cuda_us(lambda: a @ b, iters=10)
    return 2 * n ** 3 / (us * 1e-6) / 1e12
