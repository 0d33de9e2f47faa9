"""The fused MoE's decode gate-up with the parity planes (dsv4_mxfp4_planes) against a minimal kernel of the same
arithmetic, on a GPU: the lead for the MoE's remaining gap to 0.6 of copy bandwidth (RESULTS.md, 2026-12-04 second
session). A compile-only prototype of the planes, timed in its own harness, ran the gate-up at 33.6 / 168.8 / 475.3 us
(1 / 8 / 32 tokens) where the landed launch takes 41 / 202 / 616 with nearly the same K-loop instruction count. The
minimal kernel keeps only what a decode gate-up needs (no masks: the widths divide the tiles; token offsets computed
once; no K splits, TMA or other paths), so timing both here, same harness, same routing, tells whether the gap is the
landed kernel's extra generality or the prototype's harness.

    python benchmark/kernels/bench_moe_planes_minimal.py [--tokens 1 8 32] [--tiles 64x128x3 64x256x3]
    TRITON_INTERPRET=1 python benchmark/kernels/bench_moe_planes_minimal.py --cpu-dry   # the glue, on CPU

Prints per token count and tile (BLOCK_N x BLOCK_K x stages, 4 warps): the landed kernel's and the minimal kernel's
CUDA-graph replay time and their outputs' relative difference (should be ~1e-7: the same products, other sum order).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_mxfp4_planes import BIAS, fp4_planes, split_parity


@triton.jit
def _gate_up_minimal(x_ptr, rows_ptr, bexp_ptr, w_ptr, s_ptr, h_ptr, D, I, TOPK, E, stride_x, stride_we, stride_wn,
                     stride_se, stride_sn, stride_h, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PTX: tl.constexpr):
    blk = tl.program_id(0)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        x_rows = x_ptr + tl.where(valid, pair // TOPK, 0).to(tl.int64)[:, None] * stride_x  # once, not per K tile
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        dt = x_ptr.dtype.element_ty
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            xk = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=valid[:, None], other=0.0)
            x_even, x_odd = split_parity(xk, BLOCK_M, BLOCK_K)
            g_lo, g_hi = fp4_planes(w_e, s_e, n, n < I, k0, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K, PTX, dt, True)
            u_lo, u_hi = fp4_planes(w_e, s_e, I + n, n < I, k0, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K, PTX, dt,
                                    True)
            acc_g = tl.dot(x_even, tl.trans(g_lo), acc_g)
            acc_g = tl.dot(x_odd, tl.trans(g_hi), acc_g)
            acc_u = tl.dot(x_even, tl.trans(u_lo), acc_u)
            acc_u = tl.dot(x_odd, tl.trans(u_hi), acc_u)
        g = tl.minimum(acc_g * (2.0 ** BIAS), limit)
        u = tl.minimum(tl.maximum(acc_u * (2.0 ** BIAS), -limit), limit)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + r.to(tl.int64)[:, None] * stride_h + n[None, :], act.to(h_ptr.dtype.element_ty),
                 mask=valid[:, None])


def gate_up_minimal(x, rows, block_expert, w13, s13, inter: int, top_k: int, limit: float, block_n: int,
                    block_k: int, stages: int) -> torch.Tensor:
    num_blocks, hidden = block_expert.shape[0], x.shape[1]
    if hidden % block_k or inter % block_n:
        raise ValueError("the minimal kernel needs tiles that divide the widths")
    out = torch.empty(num_blocks * 16, inter, dtype=x.dtype, device=x.device)
    _gate_up_minimal[(num_blocks, inter // block_n)](
        x, rows, block_expert, w13, s13, out, hidden, inter, top_k, w13.shape[0], x.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0), s13.stride(1), out.stride(0), float(limit), BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=block_k, PTX=x.is_cuda, num_warps=4, num_stages=stages)
    return out


def main() -> None:
    from sgl_kernel.dsv4_moe_mxfp4 import MoeLaunch, dsv4_moe_align, moe_gate_up

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tiles", nargs="+", default=["64x128x3", "64x256x3", "128x128x3"])
    ap.add_argument("--cpu-dry", action="store_true", help="small widths, fp32, no PTX, no timing (interpreter)")
    args = ap.parse_args()
    dev = "cpu" if args.cpu_dry else "cuda"
    e, d, i, k = (8, 256, 128, 2) if args.cpu_dry else (256, 4096, 2048, 6)
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randint(0, 256, (e, 2 * i, d // 2), device=dev, generator=g, dtype=torch.int32).to(torch.uint8)
    s13 = torch.randint(118, 126, (e, 2 * i, d // 32), device=dev, generator=g, dtype=torch.int32).to(torch.uint8)
    for t in args.tokens:
        ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(t)])
        x = torch.randn(t, d, device=dev, generator=g) * 0.05
        x = x if args.cpu_dry else x.bfloat16()
        rows, bexp = dsv4_moe_align(ids, e, 16)
        valid = rows >= 0
        for tile in args.tiles:
            bn, bk, st = (int(v) for v in tile.split("x"))
            launch = MoeLaunch(bn, bk, 4, st, scaled_dot=False, planes=True)
            landed = lambda: moe_gate_up(x, rows, bexp, w13, s13, i, k, 10.0, 16, launch, False)  # noqa: E731
            minimal = lambda: gate_up_minimal(x, rows, bexp, w13, s13, i, k, 10.0, bn, bk, st)  # noqa: E731
            a, b = landed()[valid].float(), minimal()[valid].float()
            diff = ((a - b).norm() / a.norm()).item()
            if args.cpu_dry:
                print(f"tokens {t} tile {tile}: relative difference {diff:.1e}")
                continue
            us = [triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3 for fn in (landed, minimal)]
            print(f"tokens {t:3d} tile {tile:10s}: landed {us[0]:7.1f} us, minimal {us[1]:7.1f} us "
                  f"(relative difference {diff:.1e})", flush=True)


if __name__ == "__main__":
    main()
