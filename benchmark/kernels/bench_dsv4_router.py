"""Benchmark of dsv4_router (the MoE router in one launch) against the engine's torch path on Flash widths.

Cases: 1, 8, 32, 128, 512, 4096 tokens of bf16 activations, E 256 experts of D 4096, top-6, a score layer and a hash
layer, the router weight in fp32 (as the engine keeps it on ROCm) and bf16 (as the checkpoint stores it and the engine
keeps it on NVIDIA GPUs), with the fused shared expert's column. Per case: the GPU time of one call (time_cuda_us:
kernel time only), the time per call of a CUDA graph replaying it (launch gaps and tails included, as the engine's
decode pays them), the kernels per call (the profiler's count), for the kernel and for the torch path (dsv4_router_ref:
the engine's CPU path, op for op), and the kernel's bytes (weight + activations + outputs) as a fraction of the same
run's copy bandwidth.

    python benchmark/kernels/bench_dsv4_router.py [--sweep]

--sweep: also times launch shapes around router_launch's at each size and prints the fastest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from sgl_kernel.dsv4_router import RouterLaunch, dsv4_router, dsv4_router_ref, router_launch

try:
    from .common import BenchRow, copy_bandwidth_gbps, time_cuda_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import BenchRow, copy_bandwidth_gbps, time_cuda_us

E, D, K, VOCAB = 256, 4096, 6, 129280
TOKENS = (1, 8, 32, 128, 512, 4096)


def kernels_per_call(fn, calls: int = 5) -> float:
    """GPU kernels (and memsets / copies) one fn() launches, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) / calls


def time_graph_us(fn, replays: int = 200) -> float:
    """Per-call time of fn() captured 10 times in one CUDA graph and replayed: what a decode step pays for it."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * 10)


def _inputs(tokens: int, use_hash: bool, weight_dtype: torch.dtype) -> tuple:
    g = torch.Generator("cuda").manual_seed(tokens)
    x = torch.randn(tokens, D, generator=g, device="cuda").bfloat16()
    weight = (torch.randn(E, D, generator=g, device="cuda") * D ** -0.5 * 2).to(weight_dtype)
    if use_hash:
        tid2eid = torch.randint(0, E, (VOCAB, K), generator=g, device="cuda")
        return x, weight, None, tid2eid, torch.randint(0, VOCAB, (tokens,), generator=g, device="cuda")
    return x, weight, torch.randn(E, generator=g, device="cuda") * 0.1, None, None


def _row(tokens: int, use_hash: bool, weight_dtype: torch.dtype) -> tuple:
    args = _inputs(tokens, use_hash, weight_dtype)

    def fused():
        return dsv4_router(*args, K, 1.5, shared_expert_id=E)

    def torch_path():
        return dsv4_router_ref(*args, K, 1.5, shared_expert_id=E)

    case = f"T={tokens} {'hash' if use_hash else 'score'} w={str(weight_dtype)[6:]}"
    weight_bytes = E * D * args[1].element_size()
    row = BenchRow(kernel="dsv4_router", case=case, time_us=time_cuda_us(fused),
                   bytes_moved=weight_bytes + tokens * (2 * D + (K + 1) * 12), baseline_us=time_cuda_us(torch_path))
    extra = dict(graph_us=time_graph_us(fused), graph_ref_us=time_graph_us(torch_path),
                 kernels=kernels_per_call(fused), kernels_ref=kernels_per_call(torch_path))
    return row, extra


def _sweep(tokens: int) -> None:
    args = _inputs(tokens, False, torch.float32)
    base = router_launch(tokens, E, D)
    shapes = {base}
    for split in (1, 2, 4, 8, 16):
        for block_e in ((2, 4, 8, 16) if base.block_t < 16 else (16, 32, 64)):
            block_d = base.block_d if base.block_t >= 16 else max(16, 4096 // (base.block_t * block_e))
            for warps in (2, 4, 8):
                shapes.add(RouterLaunch(base.block_t, block_e, block_d, split, warps))
    timed = sorted((time_graph_us(lambda s=s: dsv4_router(*args, K, 1.5, launch=s), replays=50), str(s))
                   for s in shapes)
    default = time_graph_us(lambda: dsv4_router(*args, K, 1.5, launch=base), replays=50)
    print(f"  sweep T={tokens}: default {base} {default:.2f} us; best " +
          "; ".join(f"{s} {us:.2f} us" for us, s in timed[:3]))


def bench() -> list:
    return [_row(t, h, w)[0] for w in (torch.float32, torch.bfloat16) for h in (False, True) for t in TOKENS]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    cli = ap.parse_args()
    copy = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {copy:.0f} GB/s (same run)")
    print(f"{'case':24s} {'kernel':>8s} {'graph':>8s} {'launch':>6s} {'frac':>6s} | {'torch':>8s} {'graph':>8s} "
          f"{'launch':>6s}   (us; frac: of copy bandwidth)")
    for w in (torch.float32, torch.bfloat16):
        for h in (False, True):
            for t in TOKENS:
                r, x = _row(t, h, w)
                print(f"{r.case:24s} {r.time_us:8.2f} {x['graph_us']:8.2f} {x['kernels']:6.1f} "
                      f"{r.gbps() / copy:6.2f} | {r.baseline_us:8.2f} {x['graph_ref_us']:8.2f} {x['kernels_ref']:6.1f}")
    if cli.sweep:
        for t in (1, 8, 32, 128, 512):
            _sweep(t)
