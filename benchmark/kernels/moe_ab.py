"""The fused MXFP4 MoE's whole op (Flash widths, bf16, the engine's default launches: the parity planes at decode),
timed three times per token count as CUDA-graph replays, with a checksum of its output: run it under two revisions'
PYTHONPATHs, alternated, to compare them on one machine (bit-identical outputs give the same checksum).

    PYTHONPATH=REV/python:REV/sgl-kernel/python python3 benchmark/kernels/moe_ab.py [--tokens 1 8 32]

(RESULTS.md, 2026-12-04 fifth session: the scale multiplier inside the PTX, against a47df34.) --last-sums instead
compares, in one process, moe_config's launches with MoeConfig.last_sums off and on (and both with the 1-token K
splits, 4 / 2, at every count), alternated, three graph-timed runs each.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_mxfp4 import random_mxfp4_experts  # noqa: E402


def main() -> None:
    import sgl_kernel
    from sgl_kernel.dsv4_moe_mxfp4 import MoeConfig, dsv4_moe_mxfp4, moe_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--last-sums", action="store_true", help="MoeConfig.last_sums off against on, this revision")
    args = ap.parse_args()
    e, d, i, k = 256, 4096, 2048, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = random_mxfp4_experts(e, d, i, g)
    res = []
    for t in args.tokens:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        wts = torch.rand(t, k, device="cuda", generator=g)
        x = (torch.randn(t, d, device="cuda", generator=g) * 0.05).bfloat16()
        configs = {"default": None}
        if args.last_sums:
            tier = moe_config(t * k, e, planes=True)
            split = MoeConfig(16, dataclasses.replace(tier.gate_up, split_k=4),
                              dataclasses.replace(tier.down, split_k=2))
            configs = {"tier": tier, "tier+last": dataclasses.replace(tier, last_sums=True),
                       "splits": split, "splits+last": dataclasses.replace(split, last_sums=True)}
        fns = {name: functools.partial(dsv4_moe_mxfp4, x, ids, wts, w13, s13, w2, s2, 10.0, config=cfg,
                                       scales_fit_planes=True) for name, cfg in configs.items()}
        sums = {name: fn().float().abs().sum().item() for name, fn in fns.items()}
        us = {name: [] for name in fns}
        for _ in range(3):  # alternated
            for name, fn in fns.items():
                us[name].append(triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3)
        res += [f"{t} {name}: {' '.join(f'{u:.1f}' for u in us[name])} us sum {sums[name]:.6e}" for name in fns]
    print(sgl_kernel.__file__, ("\n" if args.last_sums else " | ").join(res), flush=True)


if __name__ == "__main__":
    main()
