"""Probe: the MoE's decode as GEMVs on the CUDA cores instead of 16-row MMAs (one program per (pair, row tile), the
pairs read straight from the router's ids: no sort, no padding rows, no shared memory, few registers).

Each 32-bit word of codes (8 inputs of one row) becomes four fp16x2 registers by masks and shifts (fp16 bits: the
e2m1 value * 2^-14), times the scale byte's fp16x2 multiplier 2^(s - 113), and four fp16x2 multiply-adds against the
activations' matching pairs, pre-ordered per 8 inputs as (0, 4), (2, 6), (1, 5), (3, 7); the 8-input fp16 sum is
added in fp32. `--conv mux` places the same bits in 11 integer instructions per word instead of 15 (a rotation and
two bit selects first); `--conv null` times the same kernels with the conversion replaced by one mask per register
(wrong values): the structure's cost alone. A `4` suffix sums one 32-input scale group per PTX block. Checked against
the torch reference (fp32) before timing.

    python3 benchmark/kernels/moe_gemv_probe.py [--tokens 1 2 4 8] [--block-n 32] [--block-k 256] [--warps 4]
        [--conv real real4 mux4 null] [--prefetch 0 1]

On an H100 one token's op ran ~10% faster than the landed planes, 8 tokens' 3% slower (RESULTS.md, 2026-12-05
fourteenth session); with `mux4` 14% faster at one token and as fast at 8 (fifteenth session). The engine's GEMVs
grew from it (sgl_kernel/dsv4_moe_gemv.py: the scale applied per 32-input group in fp32, activations prepared by a
kernel, programmatic dependent launches); this probe keeps the variants that lost (prefetch, tile-by-tile codes,
unrolled K loops) reproducible.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_moe_gemv import e2m1_fp16_ptx, pair_words, slot
from sgl_kernel.dsv4_moe_sums import clamped_swiglu, combine_pairs
from sgl_kernel.dsv4_mxfp4_scales import scale_layout, scale_offsets

_CONV = {
    "real": """
and.b32 t, $1, 0x000F000F;
shl.b32 a, t, 9;
shl.b32 b, t, 12;
or.b32 a, a, b;
and.b32 r0, a, 0x8E008E00;
and.b32 t, $1, 0x0F000F00;
shl.b32 a, t, 1;
shl.b32 b, t, 4;
or.b32 a, a, b;
and.b32 r1, a, 0x8E008E00;
and.b32 t, $1, 0x00F000F0;
shl.b32 a, t, 5;
shl.b32 b, t, 8;
or.b32 a, a, b;
and.b32 r2, a, 0x8E008E00;
and.b32 t, $1, 0xF000F000;
shr.b32 a, t, 3;
or.b32 a, a, t;
and.b32 r3, a, 0x8E008E00;
""",
    "mux": "\n".join(e2m1_fp16_ptx("$1")) + "\n",  # the engine's placement: 11 integer instructions per word
    "null": """
and.b32 r0, $1, 0x0E000E00;
and.b32 r1, $1, 0x0C000C00;
and.b32 r2, $1, 0x0A000A00;
and.b32 r3, $1, 0x06000600;
""",
}
# m = 2^(s - 113) in both fp16 halves: exponent field s - 113 + 15 = s - 98
_M_ADD = (-98 * 0x04000400) % 2**32


def _asm(conv: str) -> str:
    return ("{\n.reg .b32 t, a, b, m, r0, r1, r2, r3, acc;\n.reg .b16 lo, hi;\n.reg .f32 fl, fh;\n"
            f"mad.lo.u32 m, $2, 0x04000400, {_M_ADD};\n" + _CONV[conv]
            + "mul.rn.f16x2 r0, r0, m;\nmul.rn.f16x2 r1, r1, m;\nmul.rn.f16x2 r2, r2, m;\nmul.rn.f16x2 r3, r3, m;\n"
            "mul.rn.f16x2 acc, r0, $3;\nfma.rn.f16x2 acc, r1, $4, acc;\nfma.rn.f16x2 acc, r2, $5, acc;\n"
            "fma.rn.f16x2 acc, r3, $6, acc;\nmov.b32 {lo, hi}, acc;\ncvt.f32.f16 fl, lo;\ncvt.f32.f16 fh, hi;\n"
            "add.f32 fl, fl, fh;\nadd.f32 $0, fl, $7;\n}")


def _asm4(conv: str) -> str:
    """pack=4: one 32-input scale group (4 words of a row) per call, its 32 products summed in two fp16x2 chains, the
    sum in the first output (the other three 0): a third of the fp32 conversions and adds of _asm."""
    conv = _CONV[conv]
    lines = ["{", ".reg .b32 t, a, b, m, r0, r1, r2, r3, c0, c1;", ".reg .b16 lo, hi;", ".reg .f32 f0, f1, f2, f3;",
             f"mad.lo.u32 m, $8, 0x04000400, {_M_ADD};"]
    for j in range(4):
        lines.append(conv.replace("$1", f"${4 + j}").strip())
        lines += [f"mul.rn.f16x2 r{i}, r{i}, m;" for i in range(4)]
        acc = f"c{j % 2}"
        first = "mul.rn.f16x2 {a}, r0, ${x};" if j < 2 else "fma.rn.f16x2 {a}, r0, ${x}, {a};"
        lines.append(first.format(a=acc, x=12 + j))
        lines += [f"fma.rn.f16x2 {acc}, r{i}, ${12 + 4 * i + j}, {acc};" for i in range(1, 4)]
    lines += ["mov.b32 {lo, hi}, c0;", "cvt.f32.f16 f0, lo;", "cvt.f32.f16 f1, hi;", "mov.b32 {lo, hi}, c1;",
              "cvt.f32.f16 f2, lo;", "cvt.f32.f16 f3, hi;", "add.f32 f0, f0, f1;", "add.f32 f2, f2, f3;",
              "add.f32 f0, f0, f2;", "add.f32 $0, f0, $28;", "mov.b32 $1, $29;", "mov.b32 $2, $30;", "mov.b32 $3, $31;",
              "}"]
    return "\n".join(lines)


def _cons(pack: int) -> str:
    return ",".join(["=r"] * pack + ["r"] * (7 * pack))


@triton.jit
def _tile(w_e, s_e, r0, k0, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          TILED: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_N's code words [BLOCK_N, BLOCK_K / 8] at inputs k0 .. k0 + BLOCK_K and their scale bytes,
    one per word. TILED: the codes stored tile by tile (tile_layout: each program's step reads one contiguous block)."""
    rows = r0 + tl.arange(0, BLOCK_N)
    wi = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    if TILED:
        block = ((r0 // BLOCK_N) * (K // BLOCK_K) + k0 // BLOCK_K) * (BLOCK_N * BLOCK_K // 8)
        q = tl.load(w_e + block + tl.arange(0, BLOCK_N)[:, None] * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)[None, :])
    else:
        q = tl.load(w_e + rows[:, None] * stride_wn + wi[None, :])
    gi = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(s_e + scale_offsets(rows, gi, stride_sn, True)).to(tl.int32)
    return q, tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, BLOCK_K // 32, 4]), [BLOCK_N, BLOCK_K // 8])


@triton.jit
def _dots(q, s, k0, x_row, acc, ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACK: tl.constexpr,
          CONS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K / 8] fp32 plus each code word dotted with the pre-ordered fp16 activations (added inside
    the PTX; the caller sums over K once, after its loop: no cross-thread sums per step)."""
    x0, x1, x2, x3 = pair_words(x_row, k0 // 8 + tl.arange(0, BLOCK_K // 8), BLOCK_N, BLOCK_K // 8)
    return tl.inline_asm_elementwise(ASM, CONS, [q, s, x0, x1, x2, x3, acc], dtype=tl.float32, is_pure=True,
                                     pack=PACK)


@triton.jit
def _row_sums(w_e, s_e, r0, x_row, K, stride_wn, stride_sn, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PACK: tl.constexpr, CONS: tl.constexpr, PREFETCH: tl.constexpr,
              TILED: tl.constexpr, K_UNROLL: tl.constexpr):
    """[BLOCK_N] fp32: the rows dotted with the activations over all K inputs. PREFETCH: the next step's code words and
    scales are loaded before this step's are converted (two steps in flight per program: Triton does not pipeline
    these loads, they feed no MMA). K_UNROLL (K as a constant, else 0): the K loop unrolled, so every step's loads can
    be issued before the first step's conversion (as a bare read kernel's are)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    if K_UNROLL:
        for k0 in tl.static_range(0, K_UNROLL, BLOCK_K):
            q, s = _tile(w_e, s_e, r0, k0, K_UNROLL, stride_wn, stride_sn, BLOCK_N, BLOCK_K, TILED)
            acc = _dots(q, s, k0, x_row, acc, ASM, BLOCK_N, BLOCK_K, PACK, CONS)
    elif PREFETCH:
        q, s = _tile(w_e, s_e, r0, 0, K, stride_wn, stride_sn, BLOCK_N, BLOCK_K, TILED)
        for k0 in range(0, K - BLOCK_K, BLOCK_K):
            q_next, s_next = _tile(w_e, s_e, r0, k0 + BLOCK_K, K, stride_wn, stride_sn, BLOCK_N,
                                   BLOCK_K, TILED)
            acc = _dots(q, s, k0, x_row, acc, ASM, BLOCK_N, BLOCK_K, PACK, CONS)
            q, s = q_next, s_next
        acc = _dots(q, s, K - BLOCK_K, x_row, acc, ASM, BLOCK_N, BLOCK_K, PACK, CONS)
    else:
        for k0 in range(0, K, BLOCK_K):
            q, s = _tile(w_e, s_e, r0, k0, K, stride_wn, stride_sn, BLOCK_N, BLOCK_K, TILED)
            acc = _dots(q, s, k0, x_row, acc, ASM, BLOCK_N, BLOCK_K, PACK, CONS)
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, D, I, TOPK, stride_x, stride_we, stride_wn,
                         stride_se, stride_sn, stride_h, limit, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PACK: tl.constexpr, CONS: tl.constexpr, PREFETCH: tl.constexpr,
                         TILED: tl.constexpr, D_UNROLL: tl.constexpr):
    """program_id(1) = pair, program_id(0) = a tile of BLOCK_N gate rows; its gate and up rows' sums, the clamped
    SwiGLU, stored fp16 in the pre-order the down reads."""
    p = tl.program_id(1)
    e = tl.load(ids_ptr + p)
    if e >= 0:
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        x_row = x_ptr + (p // TOPK).to(tl.int64) * stride_x
        r0 = tl.program_id(0) * BLOCK_N
        g = _row_sums(w_e, s_e, r0, x_row, D, stride_wn, stride_sn, ASM, BLOCK_N, BLOCK_K, PACK, CONS, PREFETCH, TILED,
                      D_UNROLL)
        u = _row_sums(w_e, s_e, I + r0, x_row, D, stride_wn, stride_sn, ASM, BLOCK_N, BLOCK_K, PACK, CONS, PREFETCH,
                      TILED, D_UNROLL)
        act = clamped_swiglu(g, u, limit)
        tl.store(h_ptr + p.to(tl.int64) * stride_h + slot(n), act.to(tl.float16))


@triton.jit
def _gemv_down_kernel(h_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, out_ptr, D, I, stride_h, stride_we, stride_wn,
                      stride_se, stride_sn, stride_o, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PACK: tl.constexpr, CONS: tl.constexpr, PREFETCH: tl.constexpr,
                      TILED: tl.constexpr, I_UNROLL: tl.constexpr):
    """program_id(1) = pair, program_id(0) = a tile of BLOCK_N output rows: the pair's down rows times its router
    weight, fp32 (dsv4_moe_sums.combine_pairs adds a token's pairs)."""
    p = tl.program_id(1)
    e = tl.load(ids_ptr + p)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if e >= 0:
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        h_row = h_ptr + p.to(tl.int64) * stride_h
        acc = _row_sums(w_e, s_e, tl.program_id(0) * BLOCK_N, h_row, I, stride_wn, stride_sn, ASM, BLOCK_N, BLOCK_K,
                        PACK, CONS, PREFETCH, TILED, I_UNROLL)
        acc = acc * tl.load(wts_ptr + p)
    tl.store(out_ptr + p.to(tl.int64) * stride_o + n, acc)


def preorder(x: torch.Tensor) -> torch.Tensor:
    """[T, D] -> fp16 [T, D] with each 8-input group as (0, 4, 2, 6, 1, 5, 3, 7)."""
    t, d = x.shape
    return x.view(t, d // 8, 2, 2, 2).permute(0, 1, 4, 3, 2).reshape(t, d).half()


def tile_fits(block_n: int, block_k: int, warps: int, conv: str) -> bool:
    """Whether the tile holds a PTX block's words for every thread (a smaller one is replicated across threads into
    the PTX blocks: NaN seen on an H100)."""
    return block_n * block_k // 8 >= 32 * warps * (4 if conv.endswith("4") else 1)


def tile_layout(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """[E, R, K / 2] codes -> the same bytes stored tile by tile: [E, R / block_n, K / block_k, block_n, block_k / 2]
    (what a load-time layout for these GEMVs would be)."""
    e, r, half = w.shape
    return w.view(e, r // block_n, block_n, half * 2 // block_k, block_k // 2).transpose(2, 3).contiguous().view(
        e, r, half)


def gemv_moe(x, ids, wts, w13, s13, w2, s2, limit, conv="real", block_n=32, block_k=256, warps=4, prefetch=False,
             tiled=False, unroll=False):
    """tiled: w13 and w2 are in tile_layout(block_n, block_k); unroll: the K loops unrolled (K a compile-time
    constant)."""
    t, d = x.shape
    k = ids.shape[1]
    inter = w13.shape[1] // 2
    asm, pack = (_asm4(conv[:-1]), 4) if conv.endswith("4") else (_asm(conv), 1)
    if not tile_fits(block_n, block_k, warps, conv):
        raise ValueError(f"a {block_n} x {block_k} tile holds fewer code words than {warps} warps take")
    x16 = preorder(x).view(torch.int32)
    pairs = t * k
    ids_flat = ids.reshape(-1).to(torch.int32)
    wts_flat = wts.reshape(-1).float()
    h = torch.empty(pairs, inter, dtype=torch.float16, device=x.device)
    w13i, w2i = w13.view(torch.int32), w2.view(torch.int32)
    s13e, s13m, ch13 = scale_layout(s13)
    s2e, s2m, ch2 = scale_layout(s2)
    assert ch13 and ch2
    _gemv_gate_up_kernel[(inter // block_n, pairs)](
        x16, ids_flat, w13i, s13, h, d, inter, k, x16.stride(0), w13i.stride(0), w13i.stride(1), s13e, s13m,
        h.stride(0), float(limit), ASM=asm, BLOCK_N=block_n, BLOCK_K=block_k, PACK=pack, CONS=_cons(pack),
        PREFETCH=prefetch, TILED=tiled, D_UNROLL=d if unroll else 0, num_warps=warps)
    hi = h.view(torch.int32)
    out = torch.empty(pairs, d, dtype=torch.float32, device=x.device)
    _gemv_down_kernel[(d // block_n, pairs)](
        hi, ids_flat, wts_flat, w2i, s2, out, d, inter, hi.stride(0), w2i.stride(0), w2i.stride(1), s2e, s2m,
        out.stride(0), ASM=asm, BLOCK_N=block_n, BLOCK_K=block_k, PACK=pack,
        CONS=_cons(pack), PREFETCH=prefetch, TILED=tiled, I_UNROLL=inter if unroll else 0, num_warps=warps)
    return combine_pairs(out, k, x.dtype)


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench_moe_mxfp4 import copy_bandwidth, random_mxfp4_experts
    from sgl_kernel.dsv4_moe_mxfp4 import dsv4_moe_mxfp4
    from sgl_kernel.dsv4_moe_mxfp4_ref import fused_moe_mxfp4_ref

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32])
    ap.add_argument("--block-k", type=int, nargs="+", default=[256])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--conv", nargs="+", default=["real", "real4", "null"], help="real, mux, null; a 4 suffix: one "
                    "scale group per PTX block")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0], help="1: the next K step's codes loaded before "
                    "this step's are converted")
    ap.add_argument("--tiled", type=int, nargs="+", default=[0], help="1: the codes stored tile by tile")
    ap.add_argument("--unroll", type=int, nargs="+", default=[0], help="1: the K loops unrolled")
    args = ap.parse_args()
    e, d, i, k = 256, 4096, 2048, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = random_mxfp4_experts(e, d, i, g)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    for t in args.tokens:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        wts = torch.rand(t, k, device="cuda", generator=g)
        x = (torch.randn(t, d, device="cuda", generator=g) * 0.05).bfloat16()
        touched = ids.unique().numel()
        floor = touched * (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel()) / bw * 1e6
        ref = fused_moe_mxfp4_ref(x, ids, wts, w13, s13, w2, s2, 10.0)
        landed = lambda: dsv4_moe_mxfp4(x, ids, wts, w13, s13, w2, s2, 10.0, scales_fit_planes=True)  # noqa: E731
        err_l = ((landed().float() - ref).norm() / ref.norm()).item()
        t_l = min(triton.testing.do_bench_cudagraph(landed, rep=100) for _ in range(2)) * 1e3
        # inside each GEMV figure: the pre-ordering (torch ops) and the pairs' sum
        t_prep = triton.testing.do_bench_cudagraph(lambda: preorder(x), rep=50) * 1e3
        pairs = torch.randn(t * k, d, device="cuda")
        t_sum = triton.testing.do_bench_cudagraph(lambda: combine_pairs(pairs, k, x.dtype), rep=50) * 1e3
        line = [f"{t} tok ({touched} experts, floor {floor:.1f} us): landed {t_l:.1f} us ({floor / t_l:.2f}) "
                f"err {err_l:.1e}; pre-ordering {t_prep:.1f} us, pairs' sum {t_sum:.1f} us"]
        for bn in args.block_n:
            for bk in args.block_k:
                for tiled in args.tiled:
                    a13, a2 = (tile_layout(w13, bn, bk), tile_layout(w2, bn, bk)) if tiled else (w13, w2)
                    for wp, st, un, conv in itertools.product(args.warps, args.prefetch, args.unroll, args.conv):
                        if not tile_fits(bn, bk, wp, conv):
                            continue
                        fn = lambda: gemv_moe(x, ids, wts, a13, s13, a2, s2, 10.0, conv, bn, bk, wp,  # noqa: E731
                                              bool(st), bool(tiled), bool(un))
                        err = ((fn().float() - ref).norm() / ref.norm()).item()
                        us = min(triton.testing.do_bench_cudagraph(fn, rep=100) for _ in range(2)) * 1e3
                        line.append(f"gemv {conv} bn{bn} bk{bk} w{wp} p{st} t{tiled} u{un}: {us:.1f} us "
                                    f"({floor / us:.2f}) err {err:.1e}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
