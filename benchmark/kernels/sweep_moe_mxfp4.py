"""Tile sweep of the fused MXFP4 MoE kernels (sgl_kernel.dsv4_moe) at DeepSeek-V4 Flash shapes on a GPU: each
kernel (gate-up with the SwiGLU, down with the router weights) timed alone for every candidate launch, per token
count, against the bytes-read floor of the packed experts it touches (same-run copy bandwidth) or, at prefill sizes
(over 16 pairs an expert), the same run's bf16 matmul rate by the kernel's FLOPs. Prints the best launches per
(kernel, tokens) and writes every row to --out; `moe_config` takes its settings from here.

    python benchmark/kernels/sweep_moe_mxfp4.py [--tokens 1 32 256 4096] [--budget-s 420] [--planes [--planes-only]
        [--stages 4 5 6] [--maxnreg 168 200]] [--prefill-planes] [--out r.json]

Candidates: tl.dot_scaled launches beside the in-register path, with the weight codes read by pointers and through TMA
descriptors (MoeLaunch.tma: fewer registers, copies the compiler may pipeline); with --planes also the decode launches
of the PTX parity planes (MoeLaunch.planes, dsv4_moe_planes: the engine's decode path on NVIDIA GPUs; planes first or
second in the MMA, MoeLaunch.swap), the engine's planes launches and their 2 / 4 K splits (MoeLaunch.split_k) first.
For the scaled dot, K splits, 1-8-row multiply-adds and one MMA per 32-input scale group (2026-12-02) and the next K
tile prefetched into registers (2026-12-03) lost to one split at every decode size on the H200 and are not swept
(RESULTS.md "MoE kernels"); the general kernels (dsv4_moe_general) have no K splits, so only planes launches split.

Decode candidates are timed as CUDA-graph replays (the engine's decode; eager timing of a 30 us kernel measures the
host's launch), prefill ones eagerly; every candidate's output is compared with the default launches' (relative
error in the JSON). Candidates whose compile or launch fails (shared memory) are recorded as failed. The sweep stops
adding candidates once --budget-s has passed (decode candidates first), so one device call always returns its rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_moe_mxfp4 import random_mxfp4_experts  # noqa: E402
from common import copy_bandwidth_gbps, matmul_tflops  # noqa: E402


def by_pair(h: torch.Tensor, rows: torch.Tensor, pairs: int) -> torch.Tensor:
    """Intermediate rows [padded rows, I] in (token, slot) pair order, fp32 (padding rows dropped): comparable across
    block sizes."""
    valid = rows >= 0
    out = torch.zeros(pairs, h.shape[1], dtype=torch.float32, device=h.device)
    out[rows[valid]] = h[valid].float()
    return out


def main() -> None:
    from sgl_kernel.dsv4_moe import (PLANES_DOWN, PLANES_DOWN_ONE, PLANES_GATE_UP, PLANES_GATE_UP_FEW,
                                     PLANES_GATE_UP_ONE, MoeLaunch, moe_config, moe_down, moe_gate_up, tma_supported)
    from sgl_kernel.dsv4_moe_align import dsv4_moe_align

    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256, 4096])
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--planes", action="store_true", help="decode: also the parity planes' launches")
    ap.add_argument("--planes-only", action="store_true", help="decode: the planes' and the baseline launches only")
    ap.add_argument("--stages", type=int, nargs="+", default=[],
                    help="decode, with --planes: the engine's planes launches again at these num_stages, first (deeper "
                         "pipelines keep more bytes in flight per SM: one token's few programs cannot hide DRAM "
                         "latency with 3 stages of 8 K tiles)")
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[],
                    help="decode, with --planes: the engine's planes launches again under these register caps, first "
                         "(also at each --stages); more programs per SM where registers bound them "
                         "(benchmark/kernels/moe_registers.py --maxnreg shows the caps' spills)")
    ap.add_argument("--prefill-planes", action="store_true",
                    help="prefill: the parity planes' kernels at prefill blocks beside the scaled dot's default and "
                         "wider launches (instead of the scaled-dot grid)")
    ap.add_argument("--out")
    args = ap.parse_args()
    e, d, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = random_mxfp4_experts(e, d, i, g)
    bw = copy_bandwidth_gbps() * 1e9
    tflops = matmul_tflops() if any(t * k / e > 16 for t in args.tokens) else None
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s" + (f", bf16 matmul {tflops:.1f} TFLOP/s" if tflops else ""),
          flush=True)
    t0 = time.time()
    rows_out = []

    def candidates(prefill: bool):
        """tl.dot_scaled launches beside the best in-register launches, so each row compares the two paths in one
        run."""
        if prefill and args.prefill_planes:  # the parity planes at prefill blocks, the scaled dot's wider tiles
            default = moe_config(t * k, e, tma=tma_supported(x.device))
            yield default.block_m, default.gate_up
            yield default.block_m, default.down
            for bm, bn, bk, w, st in [(128, 128, 64, 8, 3), (128, 128, 128, 8, 2), (256, 64, 64, 8, 3),
                                      (128, 128, 64, 4, 3), (128, 64, 128, 4, 3), (64, 128, 64, 4, 3),
                                      (128, 256, 64, 8, 3)]:
                yield bm, MoeLaunch(bn, bk, w, st)
            for bm, bn, bk, w, st in [(128, 64, 64, 4, 3), (128, 64, 128, 4, 3), (128, 128, 64, 8, 3),
                                      (128, 128, 64, 8, 4), (128, 128, 128, 8, 2), (128, 64, 64, 8, 4),
                                      (256, 64, 64, 8, 3), (64, 128, 64, 4, 3), (128, 256, 64, 8, 3),
                                      (256, 128, 64, 8, 3), (128, 64, 128, 8, 3)]:
                yield bm, MoeLaunch(bn, bk, w, st, scaled_dot=False, planes=True)
            return
        if prefill:
            grid = itertools.product([64, 128], [64, 128], [64, 128], [4, 8], [2, 3])
            baseline = [(128, MoeLaunch(128, 128, 8, 2, scaled_dot=False)), (128, MoeLaunch(128, 64, 4, 3,
                                                                                             scaled_dot=False))]
        else:  # decode: 16-row scaled dots (earlier sweeps' winners)
            grid = itertools.product([16], [32, 64, 128], [128, 256], [4, 8], [1, 3])
            baseline = [(16, MoeLaunch(64, 256, 4, 1, scaled_dot=False))]
            if args.planes:  # the PTX parity planes (dsv4_moe_planes; random scales in range), both operand orders
                # first the engine's launches and their K splits, or none (shorter K loops for one token's few
                # experts; the gate-up's SwiGLU one launch more, the down's slices added by the MoE's last step,
                # outside this timing), so a short budget still times them; then the tile grid
                engine = [PLANES_GATE_UP_ONE, PLANES_DOWN_ONE, PLANES_GATE_UP_FEW, PLANES_GATE_UP, PLANES_DOWN]
                baseline += [(16, launch) for launch in engine]
                baseline += [(16, dataclasses.replace(launch, maxnreg=cap, num_stages=st or launch.num_stages))
                             for cap in args.maxnreg for st in [0, *args.stages] for launch in engine]
                baseline += [(16, dataclasses.replace(launch, num_stages=st)) for st in args.stages for launch in engine
                             if st != launch.num_stages]
                baseline += [(16, dataclasses.replace(launch, split_k=sk)) for launch in engine for sk in (1, 2, 4)
                             if sk != launch.split_k]
                tiles = [(bn, bk, w, 3, sw) for bn, bk, w, sw in
                         itertools.product([32, 64, 128], [128, 256], [2, 4], [False, True])]
                tiles += [(128, 128, 8, 3, False), (64, 256, 2, 2, True), (64, 256, 2, 2, False),
                          (64, 128, 4, 4, False), (128, 128, 4, 2, True),
                          # wider output tiles: the down's 8-step K loop (I = 2,048 in 256s) pays its pipeline's
                          # fill per 128 KB of codes; at 128 tokens it ran at 0.57 of copy bandwidth, the gate-up 0.78
                          (256, 128, 4, 3, False), (256, 256, 8, 2, False), (128, 128, 4, 4, False)]
                baseline += [(16, MoeLaunch(bn, bk, w, st, scaled_dot=False, planes=True, swap=sw))
                             for bn, bk, w, st, sw in tiles if MoeLaunch(bn, bk, w, st, scaled_dot=False, planes=True,
                                                                         swap=sw) not in engine]
        yield from baseline
        if args.planes_only:
            return
        for block_m, bn, bk, warps, stages in grid:
            yield block_m, MoeLaunch(bn, bk, warps, stages)
            if not prefill or (bn, bk, warps) in ((64, 64, 4), (128, 64, 4), (128, 128, 8)):  # the codes through TMA
                yield block_m, MoeLaunch(bn, bk, warps, stages, tma=True)

    for t in args.tokens:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        weights = torch.rand(t, k, device="cuda", generator=g)
        x = (torch.randn(t, d, device="cuda", generator=g) * 0.05).bfloat16()
        touched = ids.unique().numel()
        gate_up_floor = touched * (w13[0].numel() + s13[0].numel()) / bw * 1e3
        down_floor = touched * (w2[0].numel() + s2[0].numel()) / bw * 1e3
        default = moe_config(t * k, e, tma=tma_supported(x.device))  # the in-register baselines above take their own
        prefill = t * k / e > 16
        aligned = {}
        rows_d, bexp_d = dsv4_moe_align(ids, e, default.block_m)
        h_d = moe_gate_up(x, rows_d, bexp_d, w13, s13, i, k, 10.0, default.block_m, default.gate_up, False)
        # each candidate's output against the default launches' (padded rows of h are garbage: valid rows only)
        down_d = moe_down(h_d, rows_d, bexp_d, w2, s2, weights, d, default.block_m, default.down, False)
        reference = {"gate_up": by_pair(h_d, rows_d, t * k), "down": down_d.float()}
        for block_m, launch in candidates(prefill):
            if time.time() - t0 > args.budget_s:
                print(f"budget reached at tokens {t}", flush=True)
                break
            if block_m not in aligned:
                aligned[block_m] = dsv4_moe_align(ids, e, block_m)
            rows, bexp = aligned[block_m]
            for kernel in ("gate_up", "down"):
                if kernel == "gate_up":
                    fn = lambda: moe_gate_up(x, rows, bexp, w13, s13, i, k, 10.0, block_m, launch, False)  # noqa: E731
                    floor = gate_up_floor
                else:
                    h = moe_gate_up(x, rows, bexp, w13, s13, i, k, 10.0, block_m, default.gate_up, False)
                    fn = lambda: moe_down(h, rows, bexp, w2, s2, weights, d, block_m, launch, False)  # noqa: E731
                    floor = down_floor
                row = {"tokens": t, "kernel": kernel, "block_m": block_m, **dataclasses.asdict(launch)}
                try:
                    out = by_pair(fn(), rows, t * k) if kernel == "gate_up" else fn()
                    out = out.sum(0) if out.dim() == 3 else out  # the planes' down K splits: one slice each
                    ref = reference[kernel]
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    # decode kernels take ~30-700 us, near the host's launch time: replayed from a CUDA graph, as
                    # the engine runs them (weights stay partly in L2 across replays at 1 token); prefill eagerly
                    ms = (triton.testing.do_bench(fn, warmup=10, rep=40) if prefill
                          else triton.testing.do_bench_cudagraph(fn, rep=40))
                    row.update(ms=ms, floor_ms=floor, fraction_of_copy_bw=floor / ms, relative_error_vs_default=err)
                    if prefill:  # against the same run's bf16 matmul rate: the gate-up's 2I outputs, the down's D
                        flop = 2 * t * k * d * (2 * i if kernel == "gate_up" else i)
                        row.update(tflops=flop / ms / 1e9, fraction_of_matmul=flop / ms / 1e9 / tflops)
                except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: record and go on
                    row.update(failed=type(exc).__name__)
                rows_out.append(row)
        for kernel in ("gate_up", "down"):
            ok = sorted((r for r in rows_out if r["tokens"] == t and r["kernel"] == kernel and "ms" in r),
                        key=lambda r: r["ms"])
            launch = default.gate_up if kernel == "gate_up" else default.down
            base = [r for r in ok if r["block_m"] == default.block_m
                    and all(r[f.name] == getattr(launch, f.name) for f in dataclasses.fields(launch))]
            base_txt = f"default {base[0]['ms'] * 1e3:.1f} us" if base else "default not measured"
            print(f"tokens {t:5d} {kernel:8s} ({touched} experts; {base_txt}); best:", flush=True)
            for r in ok[:8 if prefill else 5]:
                rate = (f"{r['fraction_of_matmul']:.3f} of the matmul rate" if prefill
                        else f"{r['fraction_of_copy_bw']:.2f} of copy bw")
                print(f"   {r['ms'] * 1e3:9.1f} us  {rate}  bm {r['block_m']} "
                      f"bn {r['block_n']} bk {r['block_k']} w {r['num_warps']} s {r['num_stages']} "
                      f"scaled_dot {r['scaled_dot']} tma {r['tma']} planes {r['planes']} swap {r['swap']} "
                      f"split_k {r['split_k']} maxnreg {r['maxnreg']} "
                      f"(vs default {r['relative_error_vs_default']:.1e})",
                      flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
