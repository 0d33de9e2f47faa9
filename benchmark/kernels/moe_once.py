"""The fused MXFP4 MoE at Flash widths (256 experts, top-6, bf16; decode: the parity planes; scale bytes chunked as
the engine keeps them), run a few times: a target for Nsight Compute (`--clock-control none` reads the hardware
counters where the clocks cannot be locked, as on virtual machines; RESULTS.md "MoE kernels", 2026-12-04):

    ncu --clock-control none -k regex:_planes_ --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \\
        --section Occupancy python3 benchmark/kernels/moe_once.py --tokens 32 [--gate-up 64,256,2,3,1]
    ncu --clock-control none -k regex:_moe_ --launch-skip 2 --launch-count 2 --metrics ... \\
        python3 benchmark/kernels/moe_once.py --tokens 4096 [--row-major-scales]

--gate-up / --down: a decode launch other than moe_config's, as block_n,block_k,warps,stages,swap.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_moe_mxfp4 import random_mxfp4_experts  # noqa: E402

from sgl_kernel.dsv4_moe import MoeConfig, MoeLaunch, dsv4_moe_mxfp4, moe_config  # noqa: E402


def launch(spec: str, default: MoeLaunch) -> MoeLaunch:
    if not spec:
        return default
    n, k, warps, stages, swap = (int(v) for v in spec.split(","))
    return MoeLaunch(n, k, warps, stages, scaled_dot=False, planes=True, swap=bool(swap))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--gate-up", default="")
    ap.add_argument("--down", default="")
    ap.add_argument("--row-major-scales", action="store_true", help="the checkpoint's scale layout, not the engine's")
    args = ap.parse_args()
    e, d, i, k = 256, 4096, 2048, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = random_mxfp4_experts(e, d, i, g, chunk=not args.row_major_scales)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(args.tokens)])
    weights = torch.rand(args.tokens, k, device="cuda", generator=g)
    x = (torch.randn(args.tokens, d, device="cuda", generator=g) * 0.05).bfloat16()
    cfg = moe_config(args.tokens * k, e, planes=True)  # prefill sizes keep the scaled dot
    cfg = MoeConfig(cfg.block_m, launch(args.gate_up, cfg.gate_up), launch(args.down, cfg.down))
    print(cfg, "experts touched", ids.unique().numel())
    for _ in range(args.iters):
        dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
