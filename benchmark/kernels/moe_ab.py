"""The fused MXFP4 MoE's whole op (Flash widths, bf16, the engine's default launches: the parity planes at decode),
timed three times per token count as CUDA-graph replays, with a checksum of its output: run it under two revisions'
PYTHONPATHs, alternated, to compare them on one machine (bit-identical outputs give the same checksum).

    PYTHONPATH=REV/python:REV/sgl-kernel/python python3 benchmark/kernels/moe_ab.py [--tokens 1 8 32] [--gemv]
        [--gemv-variant early sum one]   (the GEMV chain's variants, against --gemv alone in one revision)
        [--gemv-launch 8x512x1]      (one GEMV tile for every token count: a tile sweep)

(RESULTS.md, 2026-12-04 fifth session: the scale multiplier inside the PTX, against a47df34.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_mxfp4 import random_mxfp4_experts  # noqa: E402


def main() -> None:
    import sgl_kernel
    from sgl_kernel.dsv4_moe_mxfp4 import dsv4_moe_mxfp4

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--gemv", action="store_true", help="up to 8 tokens through the CUDA-core GEMVs (dsv4_moe_gemv)")
    ap.add_argument("--gemv-variant", nargs="*", default=[], choices=["early", "sum", "one"],
                    help="the GEMV chain's variants (GemvLaunch.early_weights / sum_in_down / gate_up_one_loop)")
    ap.add_argument("--gemv-launch", default=None, metavar="NxK[xW]",
                    help="one GEMV tile for every token count: N weight rows x K inputs per program, W warps")
    args = ap.parse_args()
    e, d, i, k = 256, 4096, 2048, 6
    if args.gemv_variant or args.gemv_launch:
        import dataclasses

        from sgl_kernel import dsv4_moe_gemv as gemv
        flags = dict(early_weights="early" in args.gemv_variant, sum_in_down="sum" in args.gemv_variant,
                     gate_up_one_loop="one" in args.gemv_variant)
        if args.gemv_launch:
            n, kk, *w = (int(v) for v in args.gemv_launch.split("x"))
            gemv.GEMV_ONE = gemv.GEMV_FEW = gemv.GEMV_MANY = gemv.GemvLaunch(n, kk, *w)
            if not gemv.gemv_fits(gemv.GEMV_ONE, d, i):  # dsv4_moe_mxfp4 would time the planes instead
                ap.error(f"--gemv-launch {args.gemv_launch} does not fit Flash widths (gemv_fits)")
        gemv.GEMV_ONE = dataclasses.replace(gemv.GEMV_ONE, **flags)
        gemv.GEMV_FEW = dataclasses.replace(gemv.GEMV_FEW, **flags)
        gemv.GEMV_MANY = dataclasses.replace(gemv.GEMV_MANY, **flags)
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = random_mxfp4_experts(e, d, i, g)
    res = []
    for t in args.tokens:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        wts = torch.rand(t, k, device="cuda", generator=g)
        x = (torch.randn(t, d, device="cuda", generator=g) * 0.05).bfloat16()
        fn = lambda: dsv4_moe_mxfp4(x, ids, wts, w13, s13, w2, s2, 10.0, scales_fit_planes=True,  # noqa: E731
                                    gemv=args.gemv)
        checksum = fn().float().abs().sum().item()
        us = [triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3 for _ in range(3)]
        res.append(f"{t}: {' '.join(f'{u:.1f}' for u in us)} us sum {checksum:.6e}")
    print(sgl_kernel.__file__, args.gemv_launch or "", *args.gemv_variant, " | ".join(res), flush=True)


if __name__ == "__main__":
    main()
