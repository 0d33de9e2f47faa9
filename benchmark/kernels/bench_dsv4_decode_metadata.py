"""Benchmark of dsv4_decode_metadata (a decode step's attention metadata in one launch) against the engine's torch
path (dsv4_decode_metadata_ref, op for op) at Flash's shapes: window 128, ratios 4 (overlap, boundary rows) and 128,
page 128, at batch 1, 8, 32, 128, one row per request (DECODE) and 4 (a speculative verify), page tables of 8K and
128K tokens per request (the entry lists are sized by the table; every request's context fills 3/4 of it). Per
case: the GPU time of one call (time_cuda_us), the per-call time of a CUDA graph replaying it (launch gaps included,
as the engine's decode pays them), the kernels per call, and the kernel's bytes (page-table and window-map reads of
the window and the valid entries, every output written) as a fraction of the same run's copy bandwidth.

    python benchmark/kernels/bench_dsv4_decode_metadata.py
"""

from __future__ import annotations

import os
import sys

import torch

from sgl_kernel.dsv4_decode_metadata import dsv4_decode_metadata
from sgl_kernel.dsv4_decode_metadata_ref import DecodeRatioSpec, dsv4_decode_metadata_ref

try:
    from .bench_dsv4_router import kernels_per_call, time_graph_us
    from .common import BenchRow, copy_bandwidth_gbps, time_cuda_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_dsv4_router import kernels_per_call, time_graph_us
    from common import BenchRow, copy_bandwidth_gbps, time_cuda_us

WINDOW, PAGE = 128, 128
SPECS = [DecodeRatioSpec(4, True, 9, 257 * 9, boundary=True), DecodeRatioSpec(128, False, 129, 257 * 129)]
CASES = [(b, r, ctx) for ctx in (8192, 131072) for r in (1, 4) for b in (1, 8, 32, 128)]


def _inputs(batch: int, per_req: int, ctx: int) -> tuple:
    """Requests 1..batch on shuffled pages, each at a position 3/4 into its table (staggered by one)."""
    g = torch.Generator("cuda").manual_seed(batch * per_req)
    pages_per_req = ctx // PAGE
    pages = torch.randperm((batch + 1) * pages_per_req, generator=g, device="cuda").view(batch + 1, -1)
    pos = torch.arange(ctx, device="cuda")
    table = (pages[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
    full_to_swa = torch.randint(-1, 1 << 20, (int(pages.numel()) * PAGE,), generator=g, device="cuda")
    reqs = torch.arange(1, batch + 1, device="cuda")
    starts = 3 * ctx // 4 + torch.arange(batch, device="cuda")
    positions = (starts[:, None] + torch.arange(per_req, device="cuda")[None, :]).flatten()
    out_loc = table[reqs.repeat_interleave(per_req), positions].long()
    return positions, reqs, out_loc, table, full_to_swa


def _bytes(batch: int, per_req: int, ctx: int) -> float:
    rows = batch * per_req
    moved = rows * WINDOW * (4 + 8 + 8) + rows * 3 * 8  # window: table + map reads, slots; out slot, rows
    for s in SPECS:
        span = 2 * s.ratio if s.overlap else s.ratio
        moved += rows * (6 + span + s.boundary) * 8 + rows * 4  # per-row outputs, one table read
        moved += batch * (ctx // s.ratio) * 8 + batch * (3 * ctx // 4 // s.ratio) * 4  # entry lists, valid reads
    return moved


def _row(batch: int, per_req: int, ctx: int) -> tuple:
    args = _inputs(batch, per_req, ctx)

    def fused():
        return dsv4_decode_metadata(*args, WINDOW, PAGE, SPECS)

    def torch_path():
        return dsv4_decode_metadata_ref(*args, WINDOW, PAGE, SPECS)

    row = BenchRow(kernel="dsv4_decode_metadata", case=f"B={batch} R={per_req} table={ctx}",
                   time_us=time_cuda_us(fused), bytes_moved=_bytes(batch, per_req, ctx),
                   baseline_us=time_cuda_us(torch_path))
    extra = dict(graph_us=time_graph_us(fused), graph_ref_us=time_graph_us(torch_path),
                 kernels=kernels_per_call(fused), kernels_ref=kernels_per_call(torch_path))
    return row, extra


def bench() -> list:
    return [_row(*case)[0] for case in CASES]


if __name__ == "__main__":
    copy = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {copy:.0f} GB/s (same run)")
    print(f"{'case':26s} {'kernel':>8s} {'graph':>8s} {'launch':>6s} {'frac':>6s} | {'torch':>8s} {'graph':>8s} "
          f"{'launch':>6s}   (us; frac: of copy bandwidth)")
    for case in CASES:
        r, x = _row(*case)
        print(f"{r.case:26s} {r.time_us:8.2f} {x['graph_us']:8.2f} {x['kernels']:6.1f} {r.gbps() / copy:6.2f} | "
              f"{r.baseline_us:8.2f} {x['graph_ref_us']:8.2f} {x['kernels_ref']:6.1f}")
