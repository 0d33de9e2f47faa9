"""Benchmark of the fused mHC ops (sgl_kernel.dsv4_mhc) against the engine's torch path, at DeepSeek-V4-Flash widths
(n 4 streams, D 4096, bf16 streams, fn [24, 16384] fp32) and 1 / 8 / 32 / 128 tokens.

    python benchmark/kernels/bench_dsv4_mhc.py
    python benchmark/kernels/bench_dsv4_mhc.py --sweep          (hc_pre's launch sizes, one GPU, ~2 minutes)
    TRITON_INTERPRET=1 python benchmark/kernels/bench_dsv4_mhc.py --sweep --dry-run   (CPU: D 48, checks only)

Rows: hc_pre (the torch path on a GPU before the fusion: torch mixes, dsv4_hc_mix, the torch sum of u), hc_post and
hc_head against their torch code. Per row: GPU kernel time (CUDA profiler), the call captured as a CUDA graph and
replayed (wall time: what a decode step pays, each kernel's launch and tail included), kernels per call, for the
fused op and the torch path; bytes_moved = the streams (and o) read once, fn once, every output written once.
The same run's copy bandwidth prints first.

--sweep: per token count, hc_pre's default launch (hc_pre_launch), the launch before the finish was split over D
("previous"), mixes variants at the default finish and finish variants at the default mixes, then the best of each
together. Each candidate is first checked against the torch path (one that fails is reported, not timed), then timed
as a CUDA graph of SWEEP_COPIES calls, each reading its own copy of fn (96 MB: no call finds fn in L2, as in a decode
step where 25 sub-layers' fn and the experts pass through it): us per call, graph launch amortised.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import triton

from sgl_kernel.dsv4_mhc import HcPreLaunch, dsv4_hc_head, dsv4_hc_mix, dsv4_hc_post, dsv4_hc_pre, hc_pre_launch
from sglang.srt.layers.mhc import _mixes, hc_head_ref, hc_post_ref, hc_pre_ref

try:
    from .common import BenchRow, copy_bandwidth_gbps, time_cuda_us, time_eager_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import BenchRow, copy_bandwidth_gbps, time_cuda_us, time_eager_us

N, D, ITERS, EPS = 4, 4096, 20, 1e-6
TOKENS = (1, 8, 32, 128)
SWEEP_COPIES = 64  # fn copies a timed graph cycles through (64 x 1.5 MB: past an H100's / H200's 50 / 60 MB L2)
DRY_D = 48  # the dry run's stream width


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


def graph_replay_us(fn) -> float:
    """Wall time of fn captured as a CUDA graph and replayed (median of CUDA events around each replay)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_eager_us(graph.replay, iters=100, warmup=10)


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


def bench() -> list:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in TOKENS:
        m = 2 * N + N * N
        streams = torch.randn(t, N, D, device="cuda", generator=g).bfloat16()
        out = torch.randn(t, D, device="cuda", generator=g).bfloat16()
        fn = torch.randn(m, N * D, device="cuda", generator=g) * (N * D) ** -0.5
        scale, base = torch.ones(3, device="cuda"), torch.zeros(m, device="cuda")
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
    return rows


def previous_launch(t: int, n: int, d: int) -> HcPreLaunch:
    """hc_pre's launch before the finish was split over D: tl.dot mixes of 16+ token blocks, one finish program a
    token walking all D in 2048-column steps on 8 warps."""
    new = hc_pre_launch(max(t, 9), n, d)  # the tl.dot mixes (as they were at every token count)
    step = min(2048, triton.next_power_of_2(d))
    return dataclasses.replace(new, u_block_d=step, u_steps=triton.cdiv(d, step), u_warps=8)


def sweep_candidates(t: int, n: int, d: int) -> list:
    """(label, launch): the default, the previous launch, mixes variants at the default finish, finish variants at
    the default mixes; duplicates dropped."""
    base = hc_pre_launch(t, n, d)
    r = dataclasses.replace
    found = [("default", base), ("previous", previous_launch(t, n, d))]
    if not base.dot:
        mixes = [(bd, tiles, w) for bd, tiles, w in ((32, 1, 4), (32, 1, 8), (64, 1, 4), (64, 1, 8), (128, 1, 8),
                                                      (16, 1, 4), (32, 2, 4))]
        found += [(f"mixes {bd}x{tiles} w{w}", r(base, block_d=bd, d_tiles=tiles, mixes_warps=w))
                  for bd, tiles, w in mixes]
    else:
        found += [(f"mixes tiles {tiles} w{w} bt{bt}", r(base, block_t=bt, d_tiles=tiles, mixes_warps=w))
                  for tiles, w, bt in ((base.d_tiles * 2, base.mixes_warps, base.block_t),
                                       (max(1, base.d_tiles // 2), base.mixes_warps, base.block_t),
                                       (base.d_tiles, 12 - base.mixes_warps, base.block_t),
                                       (base.d_tiles, 8, 16 if base.block_t > 16 else 32))]
    finish = [(256, 1, 1), (256, 1, 2), (256, 1, 4), (256, 1, 8), (128, 1, 2), (512, 1, 4), (1024, 1, 4)]
    if t > 8:
        finish += [(1024, triton.cdiv(d, 1024), 4), (1024, triton.cdiv(d, 1024), 8), (1024, 2, 4)]
    found += [(f"finish {bd}x{steps} w{w}", r(base, u_block_d=bd, u_steps=steps, u_warps=w))
              for bd, steps, w in finish]
    seen, out = set(), []
    for label, launch in found:
        if launch not in seen:
            seen.add(launch)
            out.append((label, launch))
    return out


def _inputs(t: int, d: int, device: str, dtype: torch.dtype, copies: int) -> tuple:
    g = torch.Generator(device=device).manual_seed(t)
    m = 2 * N + N * N
    streams = torch.randn(t, N, d, device=device, generator=g).to(dtype)
    fns = [torch.randn(m, N * d, device=device, generator=g) * (N * d) ** -0.5 for _ in range(copies)]
    scale = torch.rand(3, device=device, generator=g) + 0.5
    base = torch.randn(m, device=device, generator=g)
    return streams, fns, scale, base


def check_launch(launch: HcPreLaunch, streams, fn, scale, base):
    """None where the launch's (u, post, comb) match the torch path (u before its rounding to the streams' dtype),
    else what differs."""
    got = dsv4_hc_pre(streams, fn, scale, base, ITERS, EPS, EPS, launch=launch)
    ref = hc_pre_ref(streams.float(), fn, scale, base, ITERS, EPS, EPS)
    rtol = 1e-5 if streams.dtype == torch.float32 else 2.0 ** -8 + 1e-4
    for name, a, b, tol in zip(("u", "post", "comb"), got, ref, (rtol, 1e-4, 1e-4)):
        if not torch.allclose(a.float(), b, rtol=tol, atol=1e-5):
            return f"{name} off by {(a.float() - b).abs().max().item():.3g}"
    return None


def _graph_us(call, fns) -> float:
    """us per call of a CUDA graph of one call per fn copy, replayed (median of 20)."""
    call(fns[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            call(fn)
    return time_eager_us(graph.replay, iters=20, warmup=3) / len(fns)


def _wall_us(call, fns) -> float:
    start = time.perf_counter()
    call(fns[0])
    return (time.perf_counter() - start) * 1e6


def sweep(dry_run: bool = False, tokens=TOKENS) -> dict:
    """Prints a table per token count and returns {t: (label, launch, us)} of the best candidate; on CPU (dry_run)
    the checks run at D 48 and the "times" are the interpreter's wall clock."""
    device, d = ("cpu", DRY_D) if dry_run else ("cuda", D)
    dtype = torch.float32 if dry_run else torch.bfloat16
    timer = _wall_us if dry_run else _graph_us
    best = {}
    for t in tokens:
        streams, fns, scale, base = _inputs(t, d, device, dtype, 1 if dry_run else SWEEP_COPIES)
        torch_us = timer(lambda fn: _pre_torch(streams, fn, scale, base), fns)
        rows = []

        def run(label, launch):
            error = check_launch(launch, streams, fns[0], scale, base)
            us = None if error else timer(lambda fn: dsv4_hc_pre(streams, fn, scale, base, ITERS, EPS, EPS,
                                                                 launch=launch), fns)
            rows.append((label, launch, us, error))
            return us

        for label, launch in sweep_candidates(t, N, d):
            run(label, launch)
        timed = [row for row in rows if row[2] is not None]
        mixes = min((row for row in timed if not row[0].startswith("finish")), key=lambda row: row[2])[1]
        finish = min((row for row in timed if not row[0].startswith("mixes")), key=lambda row: row[2])[1]
        both = dataclasses.replace(mixes, u_block_d=finish.u_block_d, u_steps=finish.u_steps, u_warps=finish.u_warps)
        if both not in [row[1] for row in rows]:
            run("best mixes + best finish", both)
        default_us = rows[0][2]
        print(f"\nT={t} n={N} D={d} {str(dtype).replace('torch.', '')}: torch path {torch_us:.1f} us")
        for label, launch, us, error in rows:
            shown = f"{us:8.2f} us  x{default_us / us:4.2f} of default  x{torch_us / us:5.2f} of torch" if us else \
                f"FAILED CHECK: {error}"
            print(f"  {label:26s} {shown}  {launch}")
        label, launch, us, _ = min((row for row in rows if row[2] is not None), key=lambda row: row[2])
        print(f"  best at T={t}: {label} {us:.2f} us ({launch})")
        best[t] = (label, launch, us)
    return best


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time hc_pre's candidate launches per token count")
    ap.add_argument("--dry-run", action="store_true", help="with --sweep: CPU under the interpreter, checks only")
    args = ap.parse_args()
    if args.sweep and args.dry_run:
        sweep(dry_run=True)
        sys.exit(0)
    copy = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy:.0f} GB/s (read + write)")
    if args.sweep:
        sweep()
        sys.exit(0)
    for r in bench():
        print(f"{r.kernel:12s} {r.case:22s} {r.time_us:7.1f} us {r.gbps():6.0f} GB/s ({r.gbps() / copy:5.1%} of copy)"
              f"  torch {r.baseline_us:7.1f} us  {r.note}")
