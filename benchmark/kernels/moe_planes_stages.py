"""Where the decode gate-up's time goes, without hardware counters: the parity-planes gate-up kernel
(sgl_kernel.dsv4_moe_planes) rebuilt with one stage changed at a time, each variant timed as a CUDA-graph replay at
1 / 8 / 32 tokens (Flash widths, 256 experts, top-6) against the bytes-read floor of the gate-up weights touched.

    python benchmark/kernels/moe_planes_stages.py [--modes full widen no-scale ...]

Modes (outputs are wrong in all but `full` and `chunked`: this times, it does not compute):
  full       the landed conversion (dsv4_mxfp4_planes' PTX), scale bytes row-major [E, R, G]
  widen      codes only widened to 16 bits (2 PRMT per 8 weights): loads, copies and MMAs, no conversion, no scales
  no-scale   the conversion without scale bytes or multiplies
  twice      the conversion done twice (its cost, doubled)
  cached     scale bytes of 8 rows only (every load an L1 hit): the scales' arithmetic without their memory traffic
  xor        scale bytes loaded and applied by a XOR instead of the bf16x2 multiply: the multiply's own cost
  chunked    scale bytes in dsv4_mxfp4_scales' chunked storage (one K step of consecutive rows contiguous)
RESULTS.md (2026-12-04, fourth session) has what they showed: the scale bytes' row-major loads, not the multiplies,
cost 8-11% of the kernel; hence the chunked storage.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_moe_mxfp4 import copy_bandwidth, random_mxfp4_experts  # noqa: E402

from sgl_kernel.dsv4_moe_mxfp4 import dsv4_moe_align  # noqa: E402
from sgl_kernel.dsv4_moe_planes import _acc_zeros, _mma, gate_up_rows, swiglu_store  # noqa: E402
from sgl_kernel.dsv4_mxfp4_planes import _PTX, split_parity  # noqa: E402
from sgl_kernel.dsv4_mxfp4_scales import chunked  # noqa: E402

MODES = {"full": 0, "widen": 1, "no-scale": 2, "twice": 3, "cached": 4, "xor": 5, "chunked": 6}

_WIDEN = tl.constexpr("""
{
prmt.b32 $0, $4, 0, 0x4140;
prmt.b32 $1, $4, 0, 0x4342;
prmt.b32 $2, $4, 0, 0x4140;
prmt.b32 $3, $4, 0, 0x4342;
}
""")
# the landed PTX without its multiplier and four multiplies (XOR: with a XOR by the multiplier instead)
_NO_SCALE = tl.constexpr("\n".join(ln for ln in _PTX.value.splitlines() if not ln.startswith("mad.lo"))
                         .replace("mul.rn.bf16x2 $0, x, m;", "mov.b32 $0, x;")
                         .replace("mul.rn.bf16x2 $1, y, m;", "mov.b32 $1, y;")
                         .replace("mul.rn.bf16x2 $2, x, m;", "mov.b32 $2, x;")
                         .replace("mul.rn.bf16x2 $3, y, m;", "mov.b32 $3, y;"))
_XOR = tl.constexpr(_PTX.value.replace("mul.rn.bf16x2", "xor.b32"))


@triton.jit
def _planes(w_ptr, s_ptr, rows, k0, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            MODE: tl.constexpr):
    col = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b = tl.load(w_ptr + rows[:, None] * stride_wn + col[None, :])
    if MODE == 1:  # no conversion, no scale bytes
        lo, hi = tl.inline_asm_elementwise(_WIDEN, "=r,=r,=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    elif MODE == 2:  # no scale bytes
        lo, hi = tl.inline_asm_elementwise(_NO_SCALE, "=r,=r,=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    else:
        gi = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        if MODE == 4:
            s = tl.load(s_ptr + (rows % 8)[:, None] * stride_sn + gi[None, :]).to(tl.int32)
        elif MODE == 6:  # chunked [E, G/8, R, 8]: stride_sn is the chunk stride
            s = tl.load(s_ptr + (gi // 8)[None, :] * stride_sn + rows[:, None] * 8 + (gi % 8)[None, :]).to(tl.int32)
        else:
            s = tl.load(s_ptr + rows[:, None] * stride_sn + gi[None, :]).to(tl.int32)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, BLOCK_K // 32, 16]), [BLOCK_N, BLOCK_K // 2])
        if MODE == 5:
            lo, hi = tl.inline_asm_elementwise(_XOR, "=r,=r,=r,=r,r,r,r,r,r", [b, s],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_PTX, "=r,=r,=r,=r,r,r,r,r,r", [b, s],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        if MODE == 3:
            lo2, hi2 = tl.inline_asm_elementwise(_PTX, "=r,=r,=r,=r,r,r,r,r,r", [b ^ 0x11, s],
                                                 dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            lo = lo + lo2
            hi = hi + hi2
    return lo, hi


@triton.jit
def _gate_up(x_ptr, rows_ptr, bexp_ptr, w_ptr, s_ptr, h_ptr, D, I, TOPK, E, stride_x, stride_we, stride_wn, stride_se,
             stride_sn, stride_h, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SWAP: tl.constexpr, MODE: tl.constexpr):
    """dsv4_moe_planes._planes_gate_up_kernel with its planes from _planes(MODE)."""
    blk = tl.program_id(0)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        r, valid, x_rows = gate_up_rows(x_ptr, rows_ptr, blk, TOPK, stride_x, BLOCK_M, BLOCK_K)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        acc_g = _acc_zeros(BLOCK_M, BLOCK_N, SWAP)
        acc_u = _acc_zeros(BLOCK_M, BLOCK_N, SWAP)
        for k0 in range(0, D, BLOCK_K):
            x_even, x_odd = split_parity(tl.load(x_rows + k0), BLOCK_M, BLOCK_K)
            g_lo, g_hi = _planes(w_e, s_e, n, k0, stride_wn, stride_sn, BLOCK_N, BLOCK_K, MODE)
            u_lo, u_hi = _planes(w_e, s_e, I + n, k0, stride_wn, stride_sn, BLOCK_N, BLOCK_K, MODE)
            acc_g = _mma(_mma(acc_g, x_even, g_lo, SWAP, "tf32"), x_odd, g_hi, SWAP, "tf32")
            acc_u = _mma(_mma(acc_u, x_even, u_lo, SWAP, "tf32"), x_odd, u_hi, SWAP, "tf32")
        swiglu_store(acc_g, acc_u, h_ptr, r, n, valid, stride_h, limit, SWAP)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    e, d, i, k = 256, 4096, 2048, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, _, _ = random_mxfp4_experts(e, d, i, g, chunk=False)
    s13c = chunked(s13)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    # (tokens, tile n, tile k, warps, planes first): the landed decode launches (moe_config, planes)
    for t, n, bk, warps, swap in ((1, 128, 256, 4, False), (8, 64, 256, 2, True), (32, 64, 256, 2, True)):
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        x = (torch.randn(t, d, device="cuda", generator=g) * 0.05).bfloat16()
        rows, bexp = dsv4_moe_align(ids, e, 16)
        out = torch.empty(bexp.shape[0] * 16, i, dtype=x.dtype, device="cuda")
        floor_us = ids.unique().numel() * (w13[0].numel() + s13[0].numel()) / bw * 1e6
        cells = []
        for name in args.modes:
            mode = MODES[name]
            s, s_major = (s13c, s13c.stride(2)) if name == "chunked" else (s13, s13.stride(1))

            def run(s=s, s_major=s_major, mode=mode):
                _gate_up[(bexp.shape[0], i // n)](
                    x, rows, bexp, w13, s, out, d, i, k, e, x.stride(0), w13.stride(0), w13.stride(1), s.stride(0),
                    s_major, out.stride(0), 10.0, BLOCK_M=16, BLOCK_N=n, BLOCK_K=bk, SWAP=swap, MODE=mode,
                    num_warps=warps, num_stages=3)

            run()
            us = min(triton.testing.do_bench_cudagraph(run, rep=100) for _ in range(3)) * 1e3
            cells.append(f"{name} {us:.1f} us ({floor_us / us:.2f})")
        print(f"tokens {t:2d} ({n} x {bk}, {warps} warps), floor {floor_us:.1f} us: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
