"""Benchmark of the fused mHC ops (sgl_kernel.dsv4_mhc) against the engine's torch path, at DeepSeek-V4-Flash widths
(n 4 streams, D 4096, bf16 streams, fn [24, 16384] fp32) and 1 / 8 / 32 / 128 tokens.

    python benchmark/kernels/bench_dsv4_mhc.py

Rows: hc_pre (the torch path on a GPU before the fusion: torch mixes, dsv4_hc_mix, the torch sum of u), hc_post and
hc_head against their torch code; hc_pre_norm (the decoder layer's entry: hc_pre with the sub-layer's RMSNorm folded
into its second launch) and hc_pre_norm_fp8 (the norm also quantized for an FP8 linear) against hc_pre + the separate
norm kernel as the engine ran them before (dsv4_rms_norm / dsv4_rms_norm_fp8, hc_pre's finish one program a token:
three launches). `--finish` also prints the finish's variants:
FINISH_BLOCK_C 128 (partials summed in one step at decode), SPLIT_ROLES off (one program a token: the Sinkhorn, then
u: hc_pre's second launch before the role split; pre_1role is today's hc_pre alone) and 1 Sinkhorn round (what the
20 rounds cost), each against that same three-launch baseline.
Per row: GPU kernel time (CUDA profiler), the call captured as a CUDA graph and replayed (wall time: what a decode
step pays, each kernel's launch and tail included; the pre_norm rows 20 calls a graph, per call), kernels per call,
for the fused op and the other path; bytes_moved = the streams (and o) read once, fn once, every output written once.
`--carry`: hc_post writing the next sub-layer's mixes (dsv4_hc_post_mixes) followed by the next hc_pre_norm fed them
(two launches) against dsv4_hc_post and hc_pre_norm computing its own mixes (three), per sub-layer.
`--prefill`: hc_pre_norm_fp8 at 128 / 1,024 / 8,192 rows, each kernel's GPU time as the engine runs it, with the
mixes as fp32 FMAs and a finish program a token, and with the blocked finish at every size (bench_prefill).
The same run's copy bandwidth prints first.
"""

from __future__ import annotations

import os
import sys

import torch

import sgl_kernel.dsv4_mhc as mhc_kernels
from sgl_kernel.dsv4_mhc import (dsv4_hc_head, dsv4_hc_mix, dsv4_hc_post, dsv4_hc_post_mixes, dsv4_hc_pre,
                                 dsv4_hc_pre_norm, dsv4_hc_pre_norm_fp8)
from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm, dsv4_rms_norm_fp8
from sglang.srt.layers.mhc import _mixes, hc_head_ref, hc_post_ref

try:
    from .common import BenchRow, copy_bandwidth_gbps, kernel_times_us, time_cuda_us, time_eager_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import BenchRow, copy_bandwidth_gbps, kernel_times_us, time_cuda_us, time_eager_us

N, D, ITERS, EPS = 4, 4096, 20, 1e-6
TOKENS = (1, 8, 32, 128)


def kernels_per_call(fn) -> float:
    """GPU kernels (and copies) one call launches, from the CUDA profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) / 5


def graph_replay_us(fn, reps: int = 1) -> float:
    """Wall time of fn captured as a CUDA graph and replayed (median of CUDA events around each replay); with `reps`
    the graph holds fn that many times and the time is per call (a decode step's graph: no graph launch per call)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return time_eager_us(graph.replay, iters=100, warmup=10) / reps


def _pre_torch(streams, fn, scale, base):
    """The engine's hc_pre on a GPU before the fusion: torch mixes, the fused weights kernel, a torch sum."""
    pre, post, comb = dsv4_hc_mix(_mixes(streams, fn, EPS), scale, base, N, ITERS, EPS)
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype), post, comb


def _row(op: str, t: int, fused, torch_path, bytes_moved: float) -> BenchRow:
    us = time_cuda_us(fused)
    base = time_cuda_us(torch_path)
    note = (f"graph replay {graph_replay_us(fused):.1f} us vs {graph_replay_us(torch_path):.1f} us; kernels "
            f"{kernels_per_call(fused):.0f} vs {kernels_per_call(torch_path):.0f}")
    return BenchRow(kernel=f"dsv4_{op}", case=f"T={t} n={N} D={D} bf16", time_us=us, bytes_moved=bytes_moved,
                    baseline_us=base, note=note)


def _row_vs(op: str, t: int, fused, unfused, bytes_moved: float, reps: int = 20) -> BenchRow:
    """fused against the kernels it replaces, both graph-replayed `reps` times a graph (what a decode step pays)."""
    return BenchRow(kernel=f"dsv4_{op}", case=f"T={t} n={N} D={D} bf16", time_us=graph_replay_us(fused, reps),
                    bytes_moved=bytes_moved, baseline_us=graph_replay_us(unfused, reps),
                    note=f"GPU time {time_cuda_us(fused):.1f} us vs {time_cuda_us(unfused):.1f} us; kernels "
                         f"{kernels_per_call(fused):.0f} vs {kernels_per_call(unfused):.0f}")


def bench_pre_norm(finish: bool = False) -> list:
    """hc_pre_norm(_fp8) against hc_pre + the norm kernel; with `finish` the finish's variants as extra rows (the
    baseline column: today's hc_pre + norm)."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for t in TOKENS:
        m = 2 * N + N * N
        streams = torch.randn(t, N, D, device="cuda", generator=g).bfloat16()
        fn = torch.randn(m, N * D, device="cuda", generator=g) * (N * D) ** -0.5
        scale, base = torch.ones(3, device="cuda"), torch.zeros(m, device="cuda")
        w = torch.randn(D, device="cuda", generator=g).bfloat16()
        moved = streams.numel() * 2 + fn.numel() * 4 + t * D * 2 + t * m * 4

        def serial_pre(iters):  # hc_pre as the engine ran it before the fold: one finish program a token
            mhc_kernels.SPLIT_ROLES = False
            try:
                return dsv4_hc_pre(streams, fn, scale, base, iters, EPS, EPS)
            finally:
                mhc_kernels.SPLIT_ROLES = True

        def unfused(iters=ITERS):
            u, post, comb = serial_pre(iters)
            return dsv4_rms_norm(u, w, EPS), post, comb

        def unfused_fp8():
            u, post, comb = serial_pre(ITERS)
            return dsv4_rms_norm_fp8(u, w, EPS), post, comb

        def fused(iters=ITERS):
            return dsv4_hc_pre_norm(streams, fn, scale, base, iters, EPS, EPS, w, EPS)

        rows.append(_row_vs("hc_pre_norm", t, fused, unfused, moved))
        rows.append(_row_vs("hc_pre_norm_fp8", t, lambda: dsv4_hc_pre_norm_fp8(streams, fn, scale, base, ITERS, EPS,
                                                                              EPS, w, EPS), unfused_fp8, moved))
        if finish:
            rows.append(_row_vs("pre_norm_1it", t, lambda: fused(1), lambda: unfused(1), moved))
            saved = mhc_kernels.FINISH_BLOCK_C, mhc_kernels.SPLIT_ROLES
            try:
                mhc_kernels.FINISH_BLOCK_C = 128
                rows.append(_row_vs("pre_norm_c128", t, fused, unfused, moved))
                mhc_kernels.FINISH_BLOCK_C, mhc_kernels.SPLIT_ROLES = saved[0], False
                rows.append(_row_vs("pre_norm_1role", t, fused, unfused, moved))
                rows.append(_row_vs("pre_1role", t, lambda: dsv4_hc_pre(streams, fn, scale, base, ITERS, EPS, EPS),
                                    unfused, moved))
            finally:
                mhc_kernels.FINISH_BLOCK_C, mhc_kernels.SPLIT_ROLES = saved
    return rows


def _inputs(t: int, g: torch.Generator) -> tuple:
    """A sub-layer's streams [t, N, D], its output o [t, D] (bf16), fn [2N + N^2, N * D], scale and base."""
    m = 2 * N + N * N
    streams = torch.randn(t, N, D, device="cuda", generator=g).bfloat16()
    out = torch.randn(t, D, device="cuda", generator=g).bfloat16()
    fn = torch.randn(m, N * D, device="cuda", generator=g) * (N * D) ** -0.5
    return streams, out, fn, torch.ones(3, device="cuda"), torch.zeros(m, device="cuda")


def bench_carry() -> list:
    """hc_post + the next hc_pre_norm, the mixes carried (2 launches) against computed by hc_pre_norm (3)."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(2)
    for t in TOKENS:
        streams, out, fn, scale, base = _inputs(t, g)
        w = torch.randn(D, device="cuda", generator=g).bfloat16()
        _, post, comb = dsv4_hc_pre(streams, fn, scale, base, ITERS, EPS, EPS)
        # the streams and o read, the new streams written and read again, fn twice, norm(u) written
        moved = 3 * streams.numel() * 2 + out.numel() * 2 + 2 * fn.numel() * 4 + t * D * 2

        def carried():
            new, partials = dsv4_hc_post_mixes(out, streams, post, comb, fn)
            return dsv4_hc_pre_norm(new, fn, scale, base, ITERS, EPS, EPS, w, EPS, partials=partials)

        def own():
            new = dsv4_hc_post(out, streams, post, comb)
            return dsv4_hc_pre_norm(new, fn, scale, base, ITERS, EPS, EPS, w, EPS)

        rows.append(_row_vs("post_carry", t, carried, own, moved))
        rows.append(_row_vs("post_mixes", t, lambda: dsv4_hc_post_mixes(out, streams, post, comb, fn),
                            lambda: dsv4_hc_post(out, streams, post, comb), 2 * streams.numel() * 2 + out.numel() * 2
                            + fn.numel() * 4))
    return rows


def bench() -> list:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in TOKENS:
        streams, out, fn, scale, base = _inputs(t, g)
        head_fn, head_scale, head_base = fn[:N].contiguous(), scale[:1], base[:N]
        _, post, comb = dsv4_hc_pre(streams, fn, scale, base, ITERS, EPS, EPS)
        s_bytes, o_bytes, w_bytes = streams.numel() * 2, out.numel() * 2, post.numel() * 4 + comb.numel() * 4
        rows.append(_row("hc_pre", t, lambda: dsv4_hc_pre(streams, fn, scale, base, ITERS, EPS, EPS),
                         lambda: _pre_torch(streams, fn, scale, base), s_bytes + fn.numel() * 4 + o_bytes + w_bytes))
        rows.append(_row("hc_post", t, lambda: dsv4_hc_post(out, streams, post, comb),
                         lambda: hc_post_ref(out, streams, post, comb), 2 * s_bytes + o_bytes + w_bytes))
        rows.append(_row("hc_head", t, lambda: dsv4_hc_head(streams, head_fn, head_scale, head_base, EPS, EPS),
                         lambda: hc_head_ref(streams, head_fn, head_scale, head_base, EPS, EPS),
                         s_bytes + head_fn.numel() * 4 + o_bytes))
    return rows + bench_pre_norm()


def bench_prefill(tokens=(128, 1024, 8192)) -> None:
    """hc_pre_norm_fp8 (a decoder layer's entry) at prefill rows: each kernel's GPU time as the engine runs it (the
    mixes as bf16 MMAs past SPLIT_MIN_ROWS, the post and Sinkhorn in 64-token programs past FINISH_BLOCKED_MIN_ROWS),
    with the mixes as fp32 FMAs and a finish program a token (ieee), with the blocked finish at every size, and the
    path before the fusion (cuBLAS fp32 mixes, dsv4_hc_mix's 64-token programs for the Sinkhorn, a torch sum, the
    norm kernel), with each one's largest difference from the ieee mixes' result; bytes_moved: the streams read once,
    norm(u) and its codes written. (Finish warps 4 / 16 and one finish role were within -3% / +13% / -4% of 8 warps
    and two roles at every size: RESULTS.md "Prefill", 2026-12-07.)"""
    g = torch.Generator(device="cuda").manual_seed(3)
    for t in tokens:
        streams, _, fn, scale, base = _inputs(t, g)
        base = torch.randn(base.shape, device="cuda", generator=g)
        w = torch.randn(D, device="cuda", generator=g).bfloat16()
        moved = streams.numel() * 2 + t * D * 3

        def call():
            return dsv4_hc_pre_norm_fp8(streams, fn, scale, base, ITERS, EPS, EPS, w, EPS)

        variants = [("ieee mixes", {"SPLIT_MIN_ROWS": None, "FINISH_BLOCKED_MIN_ROWS": None}), ("engine", {}),
                    ("split, blocked finish", {"SPLIT_MIN_ROWS": 0, "FINISH_BLOCKED_MIN_ROWS": 0})]
        ref = None
        for name, overrides in variants:
            saved = {k: getattr(mhc_kernels, k) for k in overrides}
            for k, v in overrides.items():
                setattr(mhc_kernels, k, v)
            try:
                got = call()
                ref = got if ref is None else ref
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got[:3], ref[:3]))
                times = kernel_times_us(call)
            finally:
                for k, v in saved.items():
                    setattr(mhc_kernels, k, v)
            _print_prefill_row(t, name, times, moved, diff)

        def unfused():  # cuBLAS fp32 mixes, the token-blocked weights kernel, a torch sum, the norm kernel
            pre, post, comb = dsv4_hc_mix(_mixes(streams, fn, EPS), scale, base, N, ITERS, EPS)
            u = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
            return (*dsv4_rms_norm_fp8(u, w, EPS), post, comb)

        got = unfused()
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip((got[0], got[3], got[4]), ref[:3]))
        _print_prefill_row(t, "torch mixes + mix kernel", kernel_times_us(unfused), moved, diff)


def _print_prefill_row(t: int, name: str, times: dict, moved: float, diff: float) -> None:
    total = sum(times.values())
    parts = ", ".join(f"{k.split('(')[0][:28]} {v:.1f}" for k, v in sorted(times.items(), key=lambda x: -x[1]))
    print(f"T={t:5d} {name:24s} {total:8.1f} us ({moved / total / 1e3:6.0f} GB/s of streams in, norm out) "
          f"max diff vs ieee {diff:.2e} | {parts}", flush=True)


if __name__ == "__main__":
    copy = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy:.0f} GB/s (read + write)")
    if "--prefill" in sys.argv:
        bench_prefill()
        sys.exit(0)
    rows = bench_pre_norm(finish=True) if "--finish" in sys.argv else bench_carry() if "--carry" in sys.argv \
        else bench()
    for r in rows:
        print(f"{r.kernel:12s} {r.case:22s} {r.time_us:7.1f} us {r.gbps():6.0f} GB/s ({r.gbps() / copy:5.1%} of copy)"
              f"  torch {r.baseline_us:7.1f} us  {r.note}")
