"""The fused MXFP4 MoE's decode kernels with the codes as parity planes (MoeLaunch.planes).

A packed byte holds inputs 2j (low nibble) and 2j + 1 (high nibble). Instead of tl.dot_scaled, whose e2m1 upcast
costs the compiler 5.5-7.3 SASS instructions per weight on sm90, the codes become two planes, the even inputs and the
odd inputs of the tile, and the dot over K is split by parity: acc += x_even @ lo^T + x_odd @ hi^T (no interleave).
On NVIDIA GPUs a few PTX instructions per 4 code bytes (8 weights: the scale byte's bf16x2 multiplier by one
multiply-add, 2 masks, 4 byte permutes, 4 multiply-and-masks placing each code's bits, 4 bf16x2 multiplies by it;
2.4 instructions per weight) write bf16 planes:
    bf16 bits sign << 15 | (e1 e0 m) << 6 = the e2m1 value * 2^-126 (e = 0 lands on bf16 subnormals: exact),
    times the bf16 multiplier 2^(s - 1 - BIAS) = the value * 2^(s - 127 - BIAS),
so the caller multiplies its fp32 sums by 2^BIAS. Every product is exact (an e2m1 value times a power of two) while the
scale byte s is within [SCALE_MIN, SCALE_MAX] (multipliers 2^-116 .. 2^17; real checkpoints' sit near 2^-8): callers
use the planes only where the scales were checked at load. Elsewhere (the CPU interpreter, tests) the same planes are
computed in Triton, exactly, in the activations' dtype.

Decode is where the MoE is furthest from the bandwidth floor: a few 16-row blocks per expert, each program streaming
its expert's weight rows while it converts every code. The two kernels keep only what that needs, so the K loop
issues the conversion, the MMAs and the copies and little else:
- the tiles divide the widths (no masks on codes, scales or activations; `planes_fit` says whether a launch can);
- the activation rows' addresses are computed once (padding rows read token 0 / their own garbage h row: a row of
  the product depends only on its own activation row, and those rows are never stored);
- one K range, or K splits of whole tiles chosen at compile time (SPLITS: the default launches compile to the code
  they had without splits; split gate-ups add their fp32 sums in one small SwiGLU kernel, split downs leave one slice
  per split for dsv4_moe_sums.combine_pairs).
On an H200 this lean gate-up ran 1.1-1.35x faster than the general kernel's planes branch it replaced, at the same
tiles (RESULTS.md, "MoE decode: lean parity-plane kernels, planes first in the MMA", 2026-12-04).

SWAP puts the planes first in the MMA (acc [BLOCK_N, BLOCK_M]). With 2 warps (mma.sync) that gate-up won at 8-32
tokens on the H200; with 4 warps on sm90 it becomes a wgmma fed from registers, whose operand layout costs more byte
permutes than it saves (compile-only: 594 against 457 instructions per K tile). Products and sums are those of the
general kernels (dsv4_moe_general; the torch reference is dsv4_moe_ref.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_moe_common import MoeLaunch, e2m1_value
from sgl_kernel.dsv4_moe_sums import clamped_swiglu, swiglu_splits
from sgl_kernel.dsv4_mxfp4_scales import scale_layout, scale_offsets
from sgl_kernel.dsv4_pdl import interpreting, pdl_enter, pdl_launch
from sgl_kernel.dsv4_target import dot_precision

BIAS = tl.constexpr(16)  # 2^-BIAS folded into the planes, 2^BIAS applied to the fp32 sums
SCALE_MIN, SCALE_MAX = 11, 144  # scale bytes the bf16 planes hold exactly with this BIAS

# $0, $1: low-nibble plane (elements 0-1, 2-3 of the 4 bytes in $4); $2, $3: high-nibble plane; $5: the scale byte of
# the 4 bytes (8 consecutive inputs of one row: one 32-input group; $6-$8 repeat it). m = its bf16x2 multiplier
# 2^(s - 1 - BIAS) in both halves, (s + 126 - BIAS) << 7 | (s + 126 - BIAS) << 23, by one multiply-add. x = [0, b1, 0,
# b0] (prmt); * 0x1040 moves a low nibble's e1 e0 m (bits 0-2) to bits 6-8 and its sign (bit 3) to 15 of each half;
# * 0x104 does it for the high nibble (bits 4-6, sign 7).
_PTX = tl.constexpr("""
{
.reg .b32 h, l, x, y, m;
mad.lo.u32 m, $5, 0x00800080, %d;
and.b32 h, $4, 0xF0F0F0F0;
and.b32 l, $4, 0x0F0F0F0F;
prmt.b32 x, l, 0, 0x4140;
mul.lo.u32 x, x, 0x1040;
and.b32 x, x, 0x81C081C0;
mul.rn.bf16x2 $0, x, m;
prmt.b32 y, l, 0, 0x4342;
mul.lo.u32 y, y, 0x1040;
and.b32 y, y, 0x81C081C0;
mul.rn.bf16x2 $1, y, m;
prmt.b32 x, h, 0, 0x4140;
mul.lo.u32 x, x, 0x104;
and.b32 x, x, 0x81C081C0;
mul.rn.bf16x2 $2, x, m;
prmt.b32 y, h, 0, 0x4342;
mul.lo.u32 y, y, 0x104;
and.b32 y, y, 0x81C081C0;
mul.rn.bf16x2 $3, y, m;
}
""" % ((126 - BIAS.value) * 0x00800080))


@triton.jit
def fp4_planes(w_ptr, s_ptr, rows, row_ok, k0, K, stride_wn, stride_sn, SCALE_CHUNKED: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, dtype: tl.constexpr,
               EVEN: tl.constexpr):
    """The planes [BLOCK_N, BLOCK_K / 2] of weight rows `rows` at inputs k0 .. k0 + BLOCK_K: (even inputs, odd
    inputs), each code value * 2^(scale - 127 - BIAS) in `dtype` (bf16 where PTX; masked rows and inputs 0). EVEN: the
    tile lies inside the weight (no masks: fewer instructions per weight). Scale bytes at dsv4_mxfp4_scales' offsets
    (stride_sn: the major stride of its layout, SCALE_CHUNKED)."""
    col = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    gi = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    if EVEN:
        b = tl.load(w_ptr + rows[:, None] * stride_wn + col[None, :])
        s = tl.load(s_ptr + scale_offsets(rows, gi, stride_sn, SCALE_CHUNKED)).to(tl.int32)
    else:
        ok = row_ok[:, None] & (col < K // 2)[None, :]
        b = tl.load(w_ptr + rows[:, None] * stride_wn + col[None, :], mask=ok, other=0)
        s = tl.load(s_ptr + scale_offsets(rows, gi, stride_sn, SCALE_CHUNKED),
                    mask=row_ok[:, None] & (gi < K // 32)[None, :], other=127).to(tl.int32)
    if PTX:
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, BLOCK_K // 32, 16]), [BLOCK_N, BLOCK_K // 2])
        lo, hi = tl.inline_asm_elementwise(_PTX, "=r,=r,=r,=r,r,r,r,r,r", [b, s], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    else:
        mult = (s << 23).to(tl.float32, bitcast=True) * (2.0 ** -BIAS)
        mult = tl.reshape(tl.broadcast_to(mult[:, :, None], [BLOCK_N, BLOCK_K // 32, 16]), [BLOCK_N, BLOCK_K // 2])
        c = b.to(tl.int32)
        lo = (e2m1_value(c & 15) * mult).to(dtype)
        hi = (e2m1_value(c >> 4) * mult).to(dtype)
    return lo, hi


@triton.jit
def split_parity(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [BLOCK_M, BLOCK_K] (loaded contiguously) -> (even inputs, odd inputs), each [BLOCK_M, BLOCK_K / 2] (split in
    registers: stride-2 loads made ptxas rebuild the MMA fragments)."""
    return tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))


def planes_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """The PTX planes: NVIDIA GPUs (not ROCm, not the CPU interpreter) with bf16 activations."""
    return device.type == "cuda" and torch.version.hip is None and dtype == torch.bfloat16 and not interpreting()


@triton.jit
def _mma(acc, act, planes, SWAP: tl.constexpr, PREC: tl.constexpr):
    """acc += act @ planes^T ([BLOCK_M, BLOCK_N]), or planes @ act^T ([BLOCK_N, BLOCK_M]) when SWAP."""
    if SWAP:  # static branches, one return (Triton checks that returns agree in type)
        acc = tl.dot(planes, tl.trans(act), acc, input_precision=PREC)
    else:
        acc = tl.dot(act, tl.trans(planes), acc, input_precision=PREC)
    return acc


@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _per_row(v, SWAP: tl.constexpr):
    """A per-row (per pair) vector [BLOCK_M] broadcast against the accumulator (rows on its second dim when SWAP)."""
    if SWAP:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def _per_col(v, SWAP: tl.constexpr):
    """A per-output-column vector [BLOCK_N] broadcast against the accumulator."""
    if SWAP:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def _planes_gate_up_kernel(x_ptr, rows_ptr, bexp_ptr, w_ptr, s_ptr, h_ptr, D, I, TOPK, E, stride_x, stride_we,
                           stride_wn, stride_se, stride_sn, stride_h, limit, K_PER_SPLIT, stride_ps,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                           PTX: tl.constexpr, PREC: tl.constexpr, SCALE_CHUNKED: tl.constexpr, SPLITS: tl.constexpr,
                           PDL: tl.constexpr):
    """One 16-row block of an expert's (token, slot) pairs x one BLOCK_N tile of the intermediate dim: the gate and up
    sums over all of D, then the clamped SwiGLU silu(min(g, L)) * clamp(u, -L, L) into the block's h rows. SPLITS > 1:
    program_id(2)'s K range only, its raw gate and up sums into h_ptr [SPLITS, rows, 2I] fp32 (split stride
    stride_ps) for dsv4_moe_sums.swiglu_splits. PDL: launched as a programmatic dependent (dsv4_pdl)."""
    pdl_enter(PDL)
    blk = tl.program_id(0)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        r, valid, x_rows = gate_up_rows(x_ptr, rows_ptr, blk, TOPK, stride_x, BLOCK_M, BLOCK_K)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        acc_g = _acc_zeros(BLOCK_M, BLOCK_N, SWAP)
        acc_u = _acc_zeros(BLOCK_M, BLOCK_N, SWAP)
        k_lo, k_hi = k_range(D, K_PER_SPLIT, BLOCK_K, SPLITS)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x_even, x_odd = split_parity(tl.load(x_rows + k0), BLOCK_M, BLOCK_K)
            dt = x_even.dtype
            g_lo, g_hi = fp4_planes(w_e, s_e, n, n < I, k0, D, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_N, BLOCK_K,
                                    PTX, dt, True)
            u_lo, u_hi = fp4_planes(w_e, s_e, I + n, n < I, k0, D, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_N,
                                    BLOCK_K, PTX, dt, True)
            acc_g = _mma(_mma(acc_g, x_even, g_lo, SWAP, PREC), x_odd, g_hi, SWAP, PREC)
            acc_u = _mma(_mma(acc_u, x_even, u_lo, SWAP, PREC), x_odd, u_hi, SWAP, PREC)
        if SPLITS == 1:
            swiglu_store(acc_g, acc_u, h_ptr, r, n, valid, stride_h, limit, SWAP)
        else:
            p_rows = (h_ptr + tl.program_id(2).to(tl.int64) * stride_ps + _per_row(r.to(tl.int64) * stride_h, SWAP)
                      + _per_col(n, SWAP))
            tl.store(p_rows, acc_g * (2.0 ** BIAS), mask=_per_row(valid, SWAP))
            tl.store(p_rows + I, acc_u * (2.0 ** BIAS), mask=_per_row(valid, SWAP))


@triton.jit
def k_range(K, K_PER_SPLIT, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr):
    """This program's inputs [k_lo, k_hi): all of K, or program_id(2)'s split (K_PER_SPLIT a multiple of BLOCK_K)."""
    if SPLITS == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.multiple_of(tl.program_id(2) * K_PER_SPLIT, BLOCK_K)
        k_hi = k_lo + K_PER_SPLIT
    return k_lo, k_hi


@triton.jit
def gate_up_rows(x_ptr, rows_ptr, blk, TOPK, stride_x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block blk's padded rows r, which hold a pair, and their activation rows' addresses at inputs 0 .. BLOCK_K
    (padding rows read token 0: a row of the product depends only on its own activation row, and is never stored)."""
    r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + r)
    valid = pair >= 0
    x_rows = x_ptr + tl.where(valid, pair // TOPK, 0).to(tl.int64)[:, None] * stride_x + tl.arange(0, BLOCK_K)
    return r, valid, x_rows


@triton.jit
def swiglu_store(acc_g, acc_u, h_ptr, r, n, valid, stride_h, limit, SWAP: tl.constexpr):
    """The clamped SwiGLU of the planes' gate and up sums (the weights * 2^-BIAS), into rows r of h."""
    act = clamped_swiglu(acc_g * (2.0 ** BIAS), acc_u * (2.0 ** BIAS), limit)
    h_rows = h_ptr + _per_row(r.to(tl.int64) * stride_h, SWAP) + _per_col(n, SWAP)
    tl.store(h_rows, act.to(h_ptr.dtype.element_ty), mask=_per_row(valid, SWAP))


@triton.jit
def _planes_down_kernel(h_ptr, rows_ptr, bexp_ptr, w_ptr, s_ptr, wts_ptr, out_ptr, D, I, E, stride_h, stride_we,
                        stride_wn, stride_se, stride_sn, stride_o, K_PER_SPLIT, stride_os, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, PTX: tl.constexpr,
                        PREC: tl.constexpr, SCALE_CHUNKED: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One block's h rows times a BLOCK_N tile of the expert's w2 rows, scaled by each pair's router weight, into the
    pairs' rows of out; blocks of another rank's experts (E) write zeros there. SPLITS > 1: program_id(2)'s K range
    into out's slice program_id(2) (stride_os); combine_pairs adds the slices. PDL: as the gate-up's."""
    pdl_enter(PDL)
    out_ptr, e, r, n = down_program(out_ptr, bexp_ptr, stride_os, BLOCK_M, BLOCK_N, SPLITS)
    if e <= E:
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        out_rows = out_ptr + _per_row(tl.where(valid, pair, 0).to(tl.int64) * stride_o, SWAP) + _per_col(n, SWAP)
        if e < E:
            h_rows = h_ptr + r.to(tl.int64)[:, None] * stride_h + tl.arange(0, BLOCK_K)
            w_e = w_ptr + e.to(tl.int64) * stride_we
            s_e = s_ptr + e.to(tl.int64) * stride_se
            acc = _acc_zeros(BLOCK_M, BLOCK_N, SWAP)
            k_lo, k_hi = k_range(I, K_PER_SPLIT, BLOCK_K, SPLITS)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                h_even, h_odd = split_parity(tl.load(h_rows + k0), BLOCK_M, BLOCK_K)
                lo, hi = fp4_planes(w_e, s_e, n, n < D, k0, I, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_N, BLOCK_K,
                                    PTX, h_even.dtype, True)
                acc = _mma(_mma(acc, h_even, lo, SWAP, PREC), h_odd, hi, SWAP, PREC)
            wt = tl.load(wts_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
            tl.store(out_rows, acc * (2.0 ** BIAS) * _per_row(wt, SWAP), mask=_per_row(valid, SWAP))
        else:
            tl.store(out_rows, _acc_zeros(BLOCK_M, BLOCK_N, SWAP), mask=_per_row(valid, SWAP))


@triton.jit
def down_program(out_ptr, bexp_ptr, stride_os, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """A down program's output (out_ptr, moved to its K split's slice), its block's expert, padded rows and output
    columns (grid: blocks, output tiles, K splits)."""
    blk = tl.program_id(0)
    if SPLITS > 1:
        out_ptr += tl.program_id(2).to(tl.int64) * stride_os
    e = tl.load(bexp_ptr + blk)
    r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return out_ptr, e, r, n


def planes_fit(launch: MoeLaunch, k: int, n: int) -> bool:
    """Whether `launch` can run these kernels over K = k inputs and n output rows: whole tiles, K tiles of whole
    32-input scale groups, K splits of whole tiles."""
    return (launch.block_k % 32 == 0 and k % launch.block_k == 0 and n % launch.block_n == 0 and launch.split_k >= 1
            and (k // launch.block_k) % launch.split_k == 0)


def _check(launch: MoeLaunch, k: int, n: int, dtype: torch.dtype, what: str) -> None:
    if not planes_fit(launch, k, n):
        raise ValueError(f"MoeLaunch.planes ({what}) needs tiles that divide the widths: block_k {launch.block_k} (a "
                         f"multiple of 32) must divide K {k}, block_n {launch.block_n} must divide {n}, split_k "
                         f"{launch.split_k} must divide the {k // max(1, launch.block_k)} K tiles")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"MoeLaunch.planes takes MXFP4 weights with bf16 or fp32 activations (fp16 cannot hold the "
                         f"planes' 2^-16 bias), got {dtype}")


def planes_gate_up(x, rows, block_expert, w13, s13, inter: int, top_k: int, limit: float, block_m: int,
                   launch: MoeLaunch, pdl: bool = False) -> torch.Tensor:
    """dsv4_moe.moe_gate_up for launch.planes: the activated intermediate rows [num_blocks * block_m, I]. With
    launch.split_k > 1 the splits' fp32 sums go through dsv4_moe_sums.swiglu_splits (one more launch; more programs,
    each with a shorter K loop: one token's few experts). pdl: launch it and the SwiGLU as programmatic dependents
    (dsv4_pdl; the caller checks pdl_supported)."""
    num_blocks, hidden = block_expert.shape[0], x.shape[1]
    _check(launch, hidden, inter, x.dtype, "gate-up")
    splits = launch.split_k
    out = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    part = out if splits == 1 else torch.empty(splits, num_blocks * block_m, 2 * inter, dtype=torch.float32,
                                               device=x.device)
    s_e, s_major, chunked = scale_layout(s13)
    _planes_gate_up_kernel[(num_blocks, inter // launch.block_n, splits)](
        x, rows, block_expert, w13, s13, part, hidden, inter, top_k, w13.shape[0], x.stride(0), w13.stride(0),
        w13.stride(1), s_e, s_major, part.stride(-2), float(limit), hidden // splits,
        part.stride(0) if splits > 1 else 0, BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        SWAP=launch.swap, PTX=planes_supported(x.device, x.dtype), PREC=dot_precision(x.dtype, x.device),
        SCALE_CHUNKED=chunked, SPLITS=splits, PDL=pdl, num_warps=launch.num_warps, num_stages=launch.num_stages,
        **pdl_launch(pdl), **launch.launch_options())
    return swiglu_splits(part, rows, out, limit, pdl) if splits > 1 else out


def planes_down(h, rows, block_expert, w2, s2, weights, hidden: int, block_m: int, launch: MoeLaunch,
                pdl: bool = False) -> torch.Tensor:
    """dsv4_moe.moe_down for launch.planes: each pair's weighted expert output [T * k, D] fp32 (weights: the
    router weights flattened, fp32); with launch.split_k > 1 one such slice per K split, [splits, T * k, D]
    (dsv4_moe_sums.combine_pairs adds them). pdl: as planes_gate_up's."""
    num_blocks, inter = block_expert.shape[0], h.shape[1]
    _check(launch, inter, hidden, h.dtype, "down")
    splits = launch.split_k
    out = torch.empty(splits, weights.numel(), hidden, dtype=torch.float32, device=h.device)
    s_e, s_major, chunked = scale_layout(s2)
    _planes_down_kernel[(num_blocks, hidden // launch.block_n, splits)](
        h, rows, block_expert, w2, s2, weights, out, hidden, inter, w2.shape[0], h.stride(0), w2.stride(0),
        w2.stride(1), s_e, s_major, out.stride(1), inter // splits, out.stride(0), BLOCK_M=block_m,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SWAP=launch.swap, PTX=planes_supported(h.device, h.dtype),
        PREC=dot_precision(h.dtype, h.device), SCALE_CHUNKED=chunked, SPLITS=splits, PDL=pdl,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_launch(pdl), **launch.launch_options())
    return out[0] if splits == 1 else out
