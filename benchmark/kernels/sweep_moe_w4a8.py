"""Launch sweep of the W4A8 MoE (sgl_kernel.dsv4_moe_w4a8, `--mxfp4-moe-precision fp8`) at DeepSeek-V4 Flash shapes on
a GPU: per token count, the gate-up (with its SwiGLU and quantization, and the SwiGLU over K splits where split) and
the down (with the combine that adds its pairs and splits) timed alone for every candidate launch as CUDA-graph
replays, against the bytes-read floor of the experts they touch (same-run copy bandwidth); then the whole op with
the best of each beside a8_config's launches and the W4A16 planes op. Every candidate's output is compared with
a8_config's (relative difference in the JSON: the same function, so only fp32 summation order and rare e4m3 ties).

    python benchmark/kernels/sweep_moe_w4a8.py [--tokens 1 2 4 8 32 128 4096] [--budget-s 300] [--out r.json]

Candidates that fail to compile or launch (shared memory) are recorded as failed; the sweep stops adding candidates
once --budget-s has passed, so one device call always returns its rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_moe_mxfp4 import random_mxfp4_experts  # noqa: E402
from common import copy_bandwidth_gbps  # noqa: E402


def candidates(block_m: int) -> tuple:
    """(gate-up launches, down launches) to try at this row count per block."""
    from sgl_kernel.dsv4_moe_mxfp4 import MoeLaunch

    def ml(n, k, w, s, split=1):
        return MoeLaunch(n, k, w, s, scaled_dot=False, split_k=split)

    if block_m > 16:
        return [ml(128, 128, 8, 3), ml(128, 128, 8, 4)], [ml(128, 128, 8, 3), ml(128, 256, 8, 3), ml(64, 128, 4, 3)]
    gate_up = [ml(128, k, 4, s, split) for k in (128, 256) for s in (3, 4) for split in (1, 2, 4)]
    gate_up += [ml(64, 128, 4, 3, split) for split in (2, 4)]  # split gate-ups may be 64 wide (no own quantization)
    down = [ml(n, k, 4, s, split) for n in (64, 128) for k in (128, 256) for s in (3, 4) for split in (1, 2)]
    return gate_up, down


def main() -> None:
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant
    from sgl_kernel.dsv4_moe_mxfp4 import dsv4_moe_align, dsv4_moe_mxfp4
    from sgl_kernel.dsv4_moe_sums import combine_pairs
    from sgl_kernel.dsv4_moe_w4a8 import a8_config, dsv4_moe_mxfp4_w4a8, w4a8_down, w4a8_gate_up

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128, 4096])
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--out")
    args = ap.parse_args()
    e, d, i, k, limit = 256, 4096, 2048, 6, 10.0
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = random_mxfp4_experts(e, d, i, g)
    gu_bytes = w13[0].numel() + s13[0].numel()
    dn_bytes = w2[0].numel() + s2[0].numel()
    bw = copy_bandwidth_gbps() * 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    start, rows = time.time(), []
    for t in args.tokens:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        weights = torch.rand(t, k, device="cuda", generator=g)
        wflat = weights.flatten().float().contiguous()
        x = (torch.randn(t, d, device="cuda", generator=g) * 0.5).bfloat16()
        cfg = a8_config(t * k, e)
        touched = ids.unique().numel()
        align = dsv4_moe_align(ids, e, cfg.block_m)
        xq, xs = dsv4_fp8_act_quant(x, parity=True)
        ref_h = w4a8_gate_up(xq, xs, *align, w13, s13, i, k, limit, cfg.block_m, cfg.gate_up)
        ref_out = combine_pairs(w4a8_down(*ref_h, *align, w2, s2, wflat, d, cfg.block_m, cfg.down), k, x.dtype).float()
        best = {}
        gate_ups, downs = candidates(cfg.block_m)
        for kind, launches, floor_bytes in (("gate_up", gate_ups, gu_bytes), ("down", downs, dn_bytes)):
            for launch in launches:
                if time.time() - start > args.budget_s:
                    break
                if kind == "gate_up":
                    fn = lambda: w4a8_gate_up(xq, xs, *align, w13, s13, i, k, limit, cfg.block_m, launch)  # noqa: E731
                else:
                    fn = lambda: combine_pairs(w4a8_down(*ref_h, *align, w2, s2, wflat, d, cfg.block_m,  # noqa: E731
                                                         launch), k, x.dtype)
                row = {"tokens": t, "kernel": kind, "launch": str(launch), "experts_touched": touched}
                try:
                    out = fn()
                    got = out[0].float() if kind == "gate_up" else out.float()
                    want = ref_h[0].float() if kind == "gate_up" else ref_out
                    valid = align[0] >= 0
                    if kind == "gate_up":
                        got, want = got[valid], want[valid]
                    row["rel_diff"] = ((got - want).norm() / want.norm()).item()
                    us = min(triton.testing.do_bench_cudagraph(fn, rep=100) for _ in range(2)) * 1e3
                    row.update(us=us, fraction_of_copy_bw=touched * floor_bytes / bw * 1e6 / us)
                    if us < best.get(kind, (float("inf"), None))[0]:
                        best[kind] = (us, launch)
                except Exception as ex:  # noqa: BLE001 - a launch the GPU cannot run is a row, not a crash
                    row["failed"] = f"{type(ex).__name__}: {str(ex)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
        whole = {"tokens": t, "kernel": "whole op", "experts_touched": touched}
        floor_us = touched * (gu_bytes + dn_bytes) / bw * 1e6
        ops = {"a8_config": lambda: dsv4_moe_mxfp4_w4a8(x, ids, weights, w13, s13, w2, s2, limit),
               "w4a16_planes": lambda: dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, limit,
                                                      scales_fit_planes=True)}
        if len(best) == 2:
            tuned = dataclasses.replace(cfg, gate_up=best["gate_up"][1], down=best["down"][1])
            ops["best"] = lambda: dsv4_moe_mxfp4_w4a8(x, ids, weights, w13, s13, w2, s2, limit, config=tuned)
            whole["best_launches"] = [str(tuned.gate_up), str(tuned.down)]
        for name, fn in ops.items():
            us = min(triton.testing.do_bench_cudagraph(fn, rep=200) for _ in range(3)) * 1e3
            whole[name] = {"us": us, "fraction_of_copy_bw": floor_us / us}
        rows.append(whole)
        print(json.dumps(whole), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
