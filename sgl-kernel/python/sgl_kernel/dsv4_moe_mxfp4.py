"""dsv4_moe_mxfp4 / dsv4_moe_fp8: DeepSeek-V4's routed experts from packed MXFP4 weights (W4A16) or FP8-converted
ones (W8A16, e4m3 with 128x128 block multipliers: `WEIGHT_FP8`), in three device steps.

1. `dsv4_moe_align` (one Triton program up to 2,048 pairs, else torch ops; no host read, graph-capturable): the
   (token, slot) pairs sorted by expert into blocks of BLOCK_M rows, each block one expert's, padded with -1;
   `block_expert[b]` = the block's expert. Pairs whose id is -1 (another rank's expert under expert parallelism)
   come last, in blocks of expert E: no GEMM runs for them, the down kernel only writes their rows 0. Blocks past
   the work have expert E + 1. The block count is capacity-static: ceil(T*k / BLOCK_M) + min(E + 1, T*k) bounds it.
2. `_moe_gate_up_kernel`: per block and tile of the intermediate dim, x rows (gathered by token) times the expert's
   w1 and w3 rows, then the clamped SwiGLU silu(min(g, L)) * clamp(u, -L, L), written to an intermediate row per
   padded row. Decode blocks with bf16 activations on NVIDIA GPUs (scales checked at load) take the parity planes
   (dsv4_mxfp4_planes: a few PTX instructions per 8 weights, against the scaled dot's ~6 per weight); other bf16 /
   fp16 activations with MXFP4 weights go through tl.dot_scaled (the compiler upcasts e2m1 with its e8m0 scales:
   native MX MMA where the GPU has one); fp32 activations (GPU oracle runs) and FP8 weights are dequantized in
   registers (e2m1 code value * 2^(exponent byte - 127), or e4m3 * block multiplier).
3. `_moe_down_kernel`: the intermediate rows times w2, scaled by the pair's router weight, written to the pair's row
   of a [T*k, D] fp32 buffer; the k rows of each token are summed last, in slot order (deterministic), and cast to
   the activations' dtype in the same launch (`dsv4_moe_sums.combine_pairs`).
Scale bytes come row-major (the checkpoint's [E, rows, groups]) or chunked (dsv4_mxfp4_scales: the experts module's
storage, one decode K step of consecutive rows contiguous), the layout a constexpr of every MXFP4 kernel.
Packed bytes hold inputs 2j (low nibble) and 2j + 1 (high nibble) (the OCP order tl.dot_scaled reads); the
in-register path multiplies the even and the odd input columns of the activations by the two nibble planes. The
torch reference is dsv4_moe_mxfp4_ref.py. Up to 8 decode tokens may instead take CUDA-core GEMVs straight from the
router's ids (`gemv=True`: dsv4_moe_gemv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_moe_gemv import GEMV_MAX_TOKENS, gemv_fits, gemv_launch, gemv_moe, gemv_supported
from sgl_kernel.dsv4_moe_planes import planes_down, planes_fit, planes_gate_up
from sgl_kernel.dsv4_moe_sums import clamped_swiglu, combine_pairs, swiglu_splits
from sgl_kernel.dsv4_mxfp4_planes import e2m1_value, planes_supported
from sgl_kernel.dsv4_mxfp4_scales import scale_groups, scale_layout, scale_offsets
from sgl_kernel.dsv4_pdl import pdl_enter, pdl_supported

FP4_BLOCK = 32


# Up to this many (token, slot) pairs one program sorts them (decode, short prefill chunks); more: torch ops. On an
# H200 the program took 2.4 / 9.5 / 23.1 / 217.6 us at 6 / 768 / 1,536 / 6,144 pairs, the torch ops 47-81 / 124.5 us.
ALIGN_ONE_PROGRAM_PAIRS = 2048


def dsv4_moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_program: Optional[bool] = None,
                   pdl: bool = False) -> tuple:
    """topk_ids [T, k] (-1: not this rank's expert) -> (rows [num_blocks * block_m] int64: pair index t*k + j or -1;
    block_expert [num_blocks] int64: the block's expert, num_experts for the blocks of -1 pairs, num_experts + 1 past
    the work). one_program (default: on a GPU, up to ALIGN_ONE_PROGRAM_PAIRS pairs): one Triton program instead of
    ~12 small torch kernels (decode: ~50 us of a 1-token MoE on an H200 were these launches). pdl: the one program
    lets the next kernel, launched as a programmatic dependent, be scheduled at once (dsv4_pdl)."""
    n = topk_ids.numel()
    num_blocks = triton.cdiv(n, block_m) + min(num_experts + 1, n)
    if one_program is None:
        one_program = topk_ids.is_cuda and n <= ALIGN_ONE_PROGRAM_PAIRS
    if one_program:
        return _align_one_program(topk_ids, num_experts, block_m, num_blocks, pdl)
    flat = topk_ids.flatten().long()
    flat = torch.where(flat < 0, num_experts, flat)  # other ranks' pairs: bucket E, sorted last
    device = flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read the device
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    rows = torch.full((num_blocks * block_m,), -1, dtype=torch.int64, device=device)
    rows[(ends - padded)[sorted_e] + rank] = order
    block_expert = torch.searchsorted(ends, torch.arange(num_blocks, device=device) * block_m, right=True)
    return rows, block_expert


@triton.jit
def _align_kernel(ids_ptr, rows_ptr, bexp_ptr, pad_ptr, n, E, num_rows, num_blocks, BLOCK_M: tl.constexpr,
                  P: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr):
    """dsv4_moe_align in one program, without per-pair cross-thread reductions (the pairwise-rank version spent ~30 us
    in 1,300 warp reductions at 192 pairs on an H200): per-expert counts (a histogram; padding lanes in bin EP - 1,
    past E), each expert's padding before it (an exclusive cumulative sum, kept in pad_ptr), the pairs sorted by
    (expert, pair index) (a stable sort by expert), and each sorted pair's row = its sorted position + the padding
    before its expert; each pair also writes its block's expert (every block of an expert holds one of its pairs).
    A barrier orders the fills and the scratch write before the scatters and the gather."""
    pdl_enter(PDL)
    i = tl.arange(0, P)
    ok = i < n
    ids = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
    ids = tl.where(ok, tl.where(ids < 0, E, ids), EP - 1)
    e = tl.arange(0, EP)
    counts = tl.where(e <= E, tl.histogram(ids, EP), 0)
    pad = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M - counts
    tl.store(pad_ptr + e, tl.cumsum(pad, 0) - pad)
    for r0 in range(0, num_rows, 1024):
        r = r0 + tl.arange(0, 1024)
        tl.store(rows_ptr + r, tl.full([1024], -1, tl.int64), mask=r < num_rows)
    for b0 in range(0, num_blocks, 1024):
        b = b0 + tl.arange(0, 1024)
        tl.store(bexp_ptr + b, tl.full([1024], 0, tl.int64) + E + 1, mask=b < num_blocks)
    key = tl.sort(ids * P + i)  # padding lanes (bin EP - 1) sort last
    tl.debug_barrier()
    expert = key // P
    valid = expert <= E
    row = i + tl.load(pad_ptr + expert, mask=valid, other=0, cache_modifier=".cg")
    tl.store(rows_ptr + row, (key % P).to(tl.int64), mask=valid)
    tl.store(bexp_ptr + row // BLOCK_M, expert.to(tl.int64), mask=valid)


def _align_one_program(topk_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int,
                       pdl: bool) -> tuple:
    n, device = topk_ids.numel(), topk_ids.device
    rows = torch.empty(num_blocks * block_m, dtype=torch.int64, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int64, device=device)
    ep = triton.next_power_of_2(num_experts + 2)  # bins 0..E and one past for padding lanes
    pad_before = torch.empty(ep, dtype=torch.int32, device=device)
    p = max(16, triton.next_power_of_2(n))
    if p > 16384 or ep * p >= 2**31:  # shared memory for the sort; keys expert * P + pair in int32
        raise ValueError(f"one_program aligns up to 16,384 pairs with expert * pairs < 2^31, got {n} pairs and "
                         f"{num_experts} experts: use one_program=False")
    _align_kernel[(1,)](topk_ids.contiguous().view(-1), rows, block_expert, pad_before, n, num_experts, rows.numel(),
                        num_blocks, BLOCK_M=block_m, P=p, EP=ep, PDL=pdl,
                        num_warps=4 if p <= 256 else 8 if p <= 2048 else 16)
    return rows, block_expert


@triton.jit
def _fp4_tile(w_ptr, s_ptr, rows, row_ok, k0, K, stride_wn, stride_sn, SCALE_CHUNKED: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BCAST: tl.constexpr):
    """The dequantized even-input and odd-input planes [BLOCK_N, BLOCK_K / 2] of weight rows `rows` at inputs
    k0 .. k0 + BLOCK_K. SCALE_BCAST: one scale byte loaded per 32 inputs and broadcast over its 16 packed bytes
    (fewer loads, a register reshape); else one (cached) scale load per packed byte."""
    j = tl.arange(0, BLOCK_K // 2)
    col = k0 // 2 + j
    ok = row_ok[:, None] & (col < K // 2)[None, :]
    b = tl.load(w_ptr + rows[:, None] * stride_wn + col[None, :], mask=ok, other=0).to(tl.int32)
    if SCALE_BCAST:
        gi = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + scale_offsets(rows, gi, stride_sn, SCALE_CHUNKED),
                    mask=row_ok[:, None] & (gi < K // 32)[None, :], other=127).to(tl.int32)
        mult = (s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
        mult = tl.reshape(tl.broadcast_to(mult[:, :, None], [BLOCK_N, BLOCK_K // 32, 16]), [BLOCK_N, BLOCK_K // 2])
    else:
        s = tl.load(s_ptr + scale_offsets(rows, (k0 + 2 * j) // 32, stride_sn, SCALE_CHUNKED), mask=ok, other=127)
        mult = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return e2m1_value(b & 15) * mult, e2m1_value(b >> 4) * mult


@triton.jit
def _fp4_scales(s_ptr, rows, row_ok, k0, K, stride_sn, SCALE_CHUNKED: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scale bytes [BLOCK_N, BLOCK_K / 32] of weight rows `rows` at inputs k0 .. k0 + BLOCK_K (masked: 2^0)."""
    gi = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    return tl.load(s_ptr + scale_offsets(rows, gi, stride_sn, SCALE_CHUNKED),
                   mask=row_ok[:, None] & (gi < K // 32)[None, :], other=127)


@triton.jit
def _fp4_packed(w_ptr, s_ptr, rows, row_ok, k0, K, stride_wn, stride_sn, SCALE_CHUNKED: tl.constexpr,
                BLOCK_K: tl.constexpr, w_desc, desc_row, TMA: tl.constexpr):
    """The packed codes [BLOCK_N, BLOCK_K / 2] and scale bytes [BLOCK_N, BLOCK_K / 32] of weight rows `rows` at inputs
    k0 .. k0 + BLOCK_K, as tl.dot_scaled takes them (the compiler's e2m1 upcast; masked codes 0, scales 2^0).
    TMA: the codes through the tensor descriptor `w_desc` over all experts' rows [E * rows per expert, K / 2], from
    row `desc_row` (the first of `rows`): no address registers, and the compiler may pipeline the copies; rows past
    this projection's (another projection's or expert's, or zeros past the tensor) only reach masked outputs."""
    if TMA:
        b = w_desc.load([desc_row.to(tl.int32), k0 // 2])  # < 2^31 rows: E * 2I is ~1 M at Flash's sizes
    else:
        col = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(w_ptr + rows[:, None] * stride_wn + col[None, :], mask=row_ok[:, None] & (col < K // 2)[None, :],
                    other=0)
    return b, _fp4_scales(s_ptr, rows, row_ok, k0, K, stride_sn, SCALE_CHUNKED, BLOCK_K)


@triton.jit
def _x_rows(x_ptr, tok, valid, stride_x, k0, K, BLOCK_K: tl.constexpr):
    """Activation rows [BLOCK_M, BLOCK_K] of tokens `tok` at inputs k0 .. k0 + BLOCK_K (invalid rows and inputs 0)."""
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + tok.to(tl.int64)[:, None] * stride_x + k[None, :], mask=valid[:, None] & (k < K)[None, :],
                   other=0.0)


@triton.jit
def _fp8_tile(w_ptr, s_ptr, rows, row_ok, k0, K, stride_wn, stride_sr, BLOCK_K: tl.constexpr):
    """The dequantized FP8 tile [BLOCK_N, BLOCK_K] of weight rows `rows` at inputs k0 .. k0 + BLOCK_K: e4m3 codes
    times their 128x128 block's fp32 multiplier (`s_ptr` at this projection's scale grid, rows of 128)."""
    k = k0 + tl.arange(0, BLOCK_K)
    ok = row_ok[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (rows // 128)[:, None] * stride_sr + (k // 128)[None, :], mask=ok, other=0.0)
    return w * s


@triton.jit
def _moe_gate_up_kernel(x_ptr, rows_ptr, bexp_ptr, w_ptr, w_desc, s_ptr, h_ptr, D, I, TOPK, E, stride_x, stride_we,
                        stride_wn, stride_se, stride_sn, stride_h, stride_shalf, limit, K_PER_SPLIT, stride_ps,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        WEIGHT_FP8: tl.constexpr, SCALE_BCAST: tl.constexpr, PREC: tl.constexpr, A_FMT: tl.constexpr,
                        SPLIT_K: tl.constexpr, TMA: tl.constexpr, SCALE_CHUNKED: tl.constexpr):
    """SPLIT_K > 1: program_id(2) sums K [split * K_PER_SPLIT, ...) only and writes the raw fp32 gate and up sums to
    h_ptr [SPLIT_K, rows, 2, I] (stride_ps per split); the caller sums the splits and applies the SwiGLU. TMA: the
    scaled dot's weight codes through `w_desc` (_fp4_packed)."""
    blk = tl.program_id(0)
    # K_PER_SPLIT is a multiple of BLOCK_K (_k_splits): said, so the chunked scale bytes' offsets of a K tile are
    # known contiguous (else the compiler lays their loads out across warps and reshuffles them: 14% slower)
    k_lo = tl.multiple_of(tl.program_id(2) * K_PER_SPLIT, BLOCK_K)
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, D)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        tok = tl.where(valid, pair // TOPK, 0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        j = tl.arange(0, BLOCK_K // 2)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if A_FMT != "":  # 16-bit activations, e2m1 weights: the compiler's scaled dot
                xk = _x_rows(x_ptr, tok, valid, stride_x, k0, D, BLOCK_K)
                first = e * 2 * I + tl.program_id(1) * BLOCK_N  # w13's gate rows of this tile, all experts' rows
                wg, sg = _fp4_packed(w_e, s_e, n, n_ok, k0, D, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_K, w_desc,
                                     first, TMA)
                wu, su = _fp4_packed(w_e, s_e, I + n, n_ok, k0, D, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_K,
                                     w_desc, first + I, TMA)
                acc_g = tl.dot_scaled(xk, None, A_FMT, tl.trans(wg), sg, "e2m1", acc=acc_g, fast_math=True)
                acc_u = tl.dot_scaled(xk, None, A_FMT, tl.trans(wu), su, "e2m1", acc=acc_u, fast_math=True)
            elif WEIGHT_FP8:  # rows of w13 [2I, D] e4m3; scales [2, I/128, D/128]: gate half 0, up half 1
                xk = _x_rows(x_ptr, tok, valid, stride_x, k0, D, BLOCK_K)
                g = _fp8_tile(w_e, s_e, n, n_ok, k0, D, stride_wn, stride_sn, BLOCK_K)
                u = _fp8_tile(w_e + I * stride_wn, s_e + stride_shalf, n, n_ok, k0, D, stride_wn, stride_sn,
                              BLOCK_K)
                acc_g += tl.dot(xk, tl.trans(g.to(xk.dtype)), out_dtype=tl.float32, input_precision=PREC)
                acc_u += tl.dot(xk, tl.trans(u.to(xk.dtype)), out_dtype=tl.float32, input_precision=PREC)
            else:
                kk = k0 + 2 * j
                x_ok = valid[:, None] & (kk < D)[None, :]
                x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_x + kk[None, :]
                x_even = tl.load(x_rows, mask=x_ok, other=0.0)
                x_odd = tl.load(x_rows + 1, mask=x_ok, other=0.0)
                g_lo, g_hi = _fp4_tile(w_e, s_e, n, n_ok, k0, D, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_N, BLOCK_K,
                                       SCALE_BCAST)
                u_lo, u_hi = _fp4_tile(w_e, s_e, I + n, n_ok, k0, D, stride_wn, stride_sn, SCALE_CHUNKED,
                                       BLOCK_N, BLOCK_K, SCALE_BCAST)
                dt = x_even.dtype
                acc_g += tl.dot(x_even, tl.trans(g_lo.to(dt)), out_dtype=tl.float32, input_precision=PREC)
                acc_g += tl.dot(x_odd, tl.trans(g_hi.to(dt)), out_dtype=tl.float32, input_precision=PREC)
                acc_u += tl.dot(x_even, tl.trans(u_lo.to(dt)), out_dtype=tl.float32, input_precision=PREC)
                acc_u += tl.dot(x_odd, tl.trans(u_hi.to(dt)), out_dtype=tl.float32, input_precision=PREC)
        if SPLIT_K == 1:
            act = clamped_swiglu(acc_g, acc_u, limit)
            h_rows = h_ptr + r.to(tl.int64)[:, None] * stride_h + n[None, :]
            tl.store(h_rows, act.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
        else:
            p_rows = h_ptr + tl.program_id(2).to(tl.int64) * stride_ps + r.to(tl.int64)[:, None] * stride_h + n[None, :]
            tl.store(p_rows, acc_g, mask=valid[:, None] & n_ok[None, :])
            tl.store(p_rows + I, acc_u, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, rows_ptr, bexp_ptr, w_ptr, w_desc, s_ptr, wts_ptr, out_ptr, D, I, E, stride_h, stride_we,
                     stride_wn, stride_se, stride_sn, stride_o, K_PER_SPLIT, stride_os,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHT_FP8: tl.constexpr,
                     SCALE_BCAST: tl.constexpr, PREC: tl.constexpr, A_FMT: tl.constexpr, TMA: tl.constexpr,
                     SCALE_CHUNKED: tl.constexpr):
    """program_id(2): the K split [split * K_PER_SPLIT, ...), writing its weighted partial sums to out_ptr's slice
    split (stride_os; 0 with one split)."""
    blk = tl.program_id(0)
    # K_PER_SPLIT is a multiple of BLOCK_K (_k_splits): said, so the chunked scale bytes' offsets of a K tile are
    # known contiguous (else the compiler lays their loads out across warps and reshuffles them: 14% slower)
    k_lo = tl.multiple_of(tl.program_id(2) * K_PER_SPLIT, BLOCK_K)
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, I)
    out_ptr += tl.program_id(2).to(tl.int64) * stride_os
    e = tl.load(bexp_ptr + blk)
    if e < E:
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < D
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        j = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if A_FMT != "":
                hk = _x_rows(h_ptr, r, valid, stride_h, k0, I, BLOCK_K)
                wb, sb = _fp4_packed(w_e, s_e, n, n_ok, k0, I, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_K, w_desc,
                                     e * D + tl.program_id(1) * BLOCK_N, TMA)
                acc = tl.dot_scaled(hk, None, A_FMT, tl.trans(wb), sb, "e2m1", acc=acc, fast_math=True)
            elif WEIGHT_FP8:
                hk = _x_rows(h_ptr, r, valid, stride_h, k0, I, BLOCK_K)
                w = _fp8_tile(w_e, s_e, n, n_ok, k0, I, stride_wn, stride_sn, BLOCK_K)
                acc += tl.dot(hk, tl.trans(w.to(hk.dtype)), out_dtype=tl.float32, input_precision=PREC)
            else:
                kk = k0 + 2 * j
                h_ok = valid[:, None] & (kk < I)[None, :]
                h_rows = h_ptr + r.to(tl.int64)[:, None] * stride_h + kk[None, :]
                h_even = tl.load(h_rows, mask=h_ok, other=0.0)
                h_odd = tl.load(h_rows + 1, mask=h_ok, other=0.0)
                lo, hi = _fp4_tile(w_e, s_e, n, n_ok, k0, I, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_N, BLOCK_K,
                                   SCALE_BCAST)
                acc += tl.dot(h_even, tl.trans(lo.to(h_even.dtype)), out_dtype=tl.float32, input_precision=PREC)
                acc += tl.dot(h_odd, tl.trans(hi.to(h_even.dtype)), out_dtype=tl.float32, input_precision=PREC)
        wt = tl.load(wts_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
        out_rows = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_o + n[None, :]
        tl.store(out_rows, acc * wt[:, None], mask=valid[:, None] & n_ok[None, :])
    elif e == E:  # pairs of another rank's experts: their rows of the pair buffer are 0
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        out_rows = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_o + n[None, :]
        tl.store(out_rows, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=valid[:, None] & (n < D)[None, :])


@dataclass(frozen=True)
class MoeLaunch:
    """One kernel's tile and launch settings."""
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    scale_bcast: bool = True  # the in-register path (fp32 activations): one scale load per 32 inputs
    scaled_dot: bool = True  # bf16 / fp16 activations x MXFP4 weights through tl.dot_scaled
    split_k: int = 1  # K splits (more programs for decode's few blocks; fp32 partial sums added after)
    # scaled dot: weight codes through a TMA tensor descriptor (no per-element address registers, copies the compiler
    # pipelines; 5-30% faster for most decode launches on an H200)
    tma: bool = False
    # MXFP4 codes as parity planes (dsv4_mxfp4_planes: PTX on NVIDIA GPUs, ~2.25 instructions per weight against the
    # scaled dot's 5.5-7.3) times the activations split by parity; bf16 or fp32 activations, scales checked at load
    planes: bool = False
    swap: bool = False  # planes: the planes as the MMA's first operand (dsv4_moe_planes; mma.sync at 2 warps)
    # planes: a register cap per thread (Triton's maxnreg, NVIDIA only): fewer registers let more programs share an SM
    # (one token's gate-up takes ~141 at 4 warps: 3 programs per SM; 128 allows 4), at the risk of spills
    maxnreg: int | None = None

    def launch_options(self) -> dict:
        """Compile options beyond warps and stages (none unless set: HIP's and the interpreter's launchers take no
        maxnreg)."""
        return {"maxnreg": self.maxnreg} if self.maxnreg else {}


@dataclass(frozen=True)
class MoeConfig:
    """Rows per expert block (both kernels) and each kernel's launch; pdl: the parity planes' decode chain (align,
    gate-up, SwiGLU over splits, down, combine) as programmatic dependent launches where the GPU has them
    (dsv4_pdl.pdl_supported)."""
    block_m: int
    gate_up: MoeLaunch
    down: MoeLaunch
    pdl: bool = True


def moe_config(num_pairs: int, num_experts: int, scaled_dot: bool = True, fp8: bool = False,
               tma: bool = False, planes: bool = False) -> MoeConfig:
    """Launch settings by pairs per expert (static for a batch size: graph capture sees one) and path (tl.dot_scaled
    for 16-bit activations with MXFP4 weights, else in-register dequantization); `tma`: the device has TMA tensor
    descriptors (`tma_supported`). From the H200 sweeps (benchmark/kernels/sweep_moe_mxfp4.py, Flash widths;
    RESULTS.md "Fused MXFP4 MoE on an H200" and later): decode (<= 16 pairs per expert) 16-row blocks with long K
    tiles; prefill 128-row blocks (64 up to 64 pairs per expert). The scaled dot beat the in-register path 1.2-4.6x
    per kernel (swapping its operands, weights as the MMA's first one, never won and was dropped; so did K splits,
    1-8-row multiply-adds and one MMA per 32-input scale group with the multiplier on the fp32 partial: 2026-12-02
    sixth session; the next K tile prefetched into registers before the current tile's MMAs, 1.2-1.5x slower:
    2026-12-03; and 8 warps: 2026-12-04). Decode, timed as CUDA-graph replays: one token's few experts want 256-wide
    K tiles unpipelined, gate-up's codes by pointers (its TMA copies were 1.2x slower), down's through TMA (19.2 us
    against 27.1 for 3-stage 128-wide tiles); from 8 tokens 3-stage 128-wide K tiles with the codes through TMA (5-12%
    faster than pointer loads at 8 and 32 tokens: RESULTS.md, 2026-12-03 second session). `planes` (the caller's
    bf16 activations and checked scales on an NVIDIA GPU: dsv4_mxfp4_planes.planes_supported): decode takes the parity
    planes' launches (dsv4_moe_planes; PLANES_GATE_UP[_ONE / _FEW], PLANES_DOWN[_ONE])."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 64 if per_expert <= 64 else 128
    if planes and block_m == 16:
        if num_pairs * 32 <= num_experts:  # one token's experts (Flash: 6 of 256): wide tiles, K splits
            return MoeConfig(16, PLANES_GATE_UP_ONE, PLANES_DOWN_ONE)
        if num_pairs * 8 <= num_experts:  # a few tokens' (Flash: 2-5)
            return MoeConfig(16, PLANES_GATE_UP_FEW, PLANES_DOWN)
        return MoeConfig(16, PLANES_GATE_UP, PLANES_DOWN)
    if scaled_dot:
        if block_m == 16 and num_pairs * 8 <= num_experts:
            return MoeConfig(16, MoeLaunch(64, 256, 4, 1), MoeLaunch(64, 256, 4, 1, tma=tma))
        if block_m == 16 and tma:
            return MoeConfig(16, MoeLaunch(64, 128, 4, 3, tma=True), MoeLaunch(128, 128, 4, 3, tma=True))
        if block_m == 16:
            return MoeConfig(16, MoeLaunch(64, 128, 4, 1), MoeLaunch(64, 128, 4, 1))
        return MoeConfig(block_m, MoeLaunch(64, 64, 4, 3), MoeLaunch(128, 64, 4, 3))
    if block_m == 16:  # scale bytes broadcast per 32 inputs beat one load per packed byte 2.8-5x everywhere
        return MoeConfig(16, MoeLaunch(32, 256, 4, 3, scaled_dot=False), MoeLaunch(64, 256, 4, 1, scaled_dot=False))
    # FP8 weight tiles need narrower gate-up tiles: 128 x 128 with 128-row blocks wants 256 KB of shared memory
    gate_up = MoeLaunch(64, 128, 4, 2, scaled_dot=False) if fp8 else MoeLaunch(128, 128, 8, 2, scaled_dot=False)
    return MoeConfig(block_m, gate_up, MoeLaunch(128, 64, 4, 3, scaled_dot=False))


# Decode launches of the parity planes (`planes`: bf16 activations on NVIDIA GPUs, scale bytes within the planes'
# exact range; dsv4_moe_planes' lean kernels), the best of the H200 sweeps (RESULTS.md): from 6 tokens (Flash)
# 256-wide K tiles, 3 stages, the gate-up with 2 warps and the planes first in the MMA (172.2 / 512.5 us at 8 / 32
# tokens), the down 128 wide with 4 warps (79.2 / 269.6 us; 2026-12-04 third session). Fewer tokens split over K
# (2026-12-04 fifth session; more programs, each with a shorter K loop): one token's gate-up 128 x 128 tiles in 4
# splits (27.6 us against 32.4 unsplit at 128 x 256), its down 128 x 256 in 2 (13.1 against 13.9 us at 64 x 256);
# 2-5 tokens' gate-up 128 x 256 in 2 (47.3 / 97.8 us at 2 / 5 tokens against 54.5 / 102.3 unsplit), their down
# PLANES_DOWN (23.4 / 50.3 us against 25.2 / 54.2 split in 2).
PLANES_GATE_UP_ONE = MoeLaunch(128, 128, 4, 3, scaled_dot=False, split_k=4, planes=True)
PLANES_DOWN_ONE = MoeLaunch(128, 256, 4, 3, scaled_dot=False, split_k=2, planes=True)
PLANES_GATE_UP_FEW = MoeLaunch(128, 256, 4, 3, scaled_dot=False, split_k=2, planes=True)
PLANES_GATE_UP = MoeLaunch(64, 256, 2, 3, scaled_dot=False, planes=True, swap=True)
PLANES_DOWN = MoeLaunch(128, 256, 4, 3, scaled_dot=False, planes=True)


def tma_supported(device: torch.device) -> bool:
    """TMA tensor descriptors for the codes (MoeLaunch.tma): NVIDIA sm90 and later with a Triton that has them; never
    on ROCm or the CPU interpreter (their launches keep pointer loads)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _TMA:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
            _TMA[index] = torch.cuda.get_device_capability(index) >= (9, 0)
        except ImportError:
            _TMA[index] = False
    return _TMA[index]


_TMA: dict = {}


def dsv4_moe_mxfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                   w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                   config: Optional[MoeConfig] = None, scales_fit_planes: bool = False,
                   gemv: bool = False) -> torch.Tensor:
    """x [T, D] (bf16/fp16/fp32), topk_ids / topk_weights [T, k], w13 uint8 [E, 2I, D/2] + w13_scale uint8
    [E, 2I, D/32], w2 uint8 [E, D, I/2] + w2_scale uint8 [E, D, I/32] -> [T, D] in x's dtype. The scale bytes may also
    come chunked ([E, rows, groups / 8, 8] views: dsv4_mxfp4_scales, the experts module's storage on the GPU).
    scales_fit_planes: every scale byte is within dsv4_mxfp4_planes' exact range (checked by the caller at load), so
    decode launches may take the PTX planes where the device has them. gemv: up to GEMV_MAX_TOKENS tokens take the
    CUDA-core GEMVs (dsv4_moe_gemv) where the device, dtype, widths and a finite limit allow (no `config` given)."""
    inter, (w13b, s13, w2b, s2) = mxfp4_experts_of(x, w13, w13_scale, w2, w2_scale)
    tokens = x.shape[0]
    if (gemv and config is None and 0 < tokens <= GEMV_MAX_TOKENS and gemv_supported(x.device, x.dtype)
            and 0 < limit < math.inf and gemv_fits(gemv_launch(tokens), x.shape[1], inter)):
        return gemv_moe(x, topk_ids, topk_weights, w13b, s13, w2b, s2, limit, inter)
    return _fused_moe(x, topk_ids, topk_weights, w13b, s13, w2b, s2, limit, inter, fp8=False, config=config,
                      planes=scales_fit_planes and planes_supported(x.device, x.dtype))


def mxfp4_experts_of(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                     w2_scale: torch.Tensor) -> tuple:
    """(intermediate size, the four tensors as uint8) after checking that they fit x (dsv4_moe_mxfp4's layouts)."""
    hidden = x.shape[1]
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    inter = two_inter // 2
    if (w13.shape[2] * 2 != hidden or w2.shape != (num_experts, hidden, inter // 2) or hidden % FP4_BLOCK
            or inter % FP4_BLOCK or scale_groups(w13_scale) != (num_experts, two_inter, hidden // FP4_BLOCK)
            or scale_groups(w2_scale) != (num_experts, hidden, inter // FP4_BLOCK) or x.stride(1) != 1):
        raise ValueError(f"MXFP4 experts w13 {tuple(w13.shape)} / {tuple(w13_scale.shape)}, w2 {tuple(w2.shape)} / "
                         f"{tuple(w2_scale.shape)} do not fit x {tuple(x.shape)}")
    return inter, tuple(t.view(torch.uint8) for t in (w13, w13_scale, w2, w2_scale))


def dsv4_moe_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                 w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                 config: Optional[MoeConfig] = None) -> torch.Tensor:
    """FP8-converted experts (e4m3 with fp32 multipliers per 128x128 block of each projection), W8A16, the same
    kernels: w13 e4m3 [E, 2I, D] (w1 rows, then w3 rows), w13_scale fp32 [E, 2, ceil(I/128), ceil(D/128)] (w1's
    grid, w3's grid), w2 e4m3 [E, D, I], w2_scale fp32 [E, 1, ceil(D/128), ceil(I/128)] -> [T, D] in x's dtype."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    nb = lambda n: -(-n // 128)  # noqa: E731
    if (w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter) or x.stride(1) != 1
            or w13_scale.shape != (num_experts, 2, nb(inter), nb(hidden))
            or w2_scale.shape != (num_experts, 1, nb(hidden), nb(inter))):
        raise ValueError(f"FP8 experts w13 {tuple(w13.shape)} / {tuple(w13_scale.shape)}, w2 {tuple(w2.shape)} / "
                         f"{tuple(w2_scale.shape)} do not fit x {tuple(x.shape)}")
    return _fused_moe(x, topk_ids, topk_weights, w13, w13_scale.float(), w2, w2_scale.float(), limit, inter, fp8=True,
                      config=config)


def _fused_moe(x, topk_ids, topk_weights, w13, s13, w2, s2, limit: float, inter: int, fp8: bool,
               config: Optional[MoeConfig] = None, planes: bool = False) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    scaled = not fp8 and x.dtype in (torch.bfloat16, torch.float16)
    pick = lambda planes: moe_config(num_tokens * top_k, num_experts, scaled_dot=scaled, fp8=fp8,  # noqa: E731
                                     tma=tma_supported(x.device), planes=planes)
    cfg = config or pick(planes)
    if config is None and cfg.gate_up.planes and not (planes_fit(cfg.gate_up, hidden, inter)
                                                      and planes_fit(cfg.down, inter, hidden)):
        cfg = pick(False)  # widths the planes' tiles do not divide (small test models): the scaled dot
    pdl = cfg.pdl and cfg.gate_up.planes and cfg.down.planes and pdl_supported(x.device)
    rows, block_expert = dsv4_moe_align(topk_ids, num_experts, cfg.block_m, pdl=pdl)
    h = moe_gate_up(x, rows, block_expert, w13, s13, inter, top_k, limit, cfg.block_m, cfg.gate_up, fp8, pdl)
    pairs = moe_down(h, rows, block_expert, w2, s2, topk_weights, hidden, cfg.block_m, cfg.down, fp8, pdl)
    return combine_pairs(pairs, top_k, x.dtype, pdl)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 engine runs (oracle checks) stay fp32 on a GPU


def _scaled_dot_format(launch: MoeLaunch, dtype: torch.dtype, fp8: bool) -> str:
    """tl.dot_scaled's activation format, or "" for the in-register dequantization (fp32 activations, FP8 weights)."""
    if not launch.scaled_dot or fp8:
        return ""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "")


def _codes_descriptor(w: torch.Tensor, launch: MoeLaunch):
    """A TMA descriptor over packed codes w [E, rows, K / 2] seen as [E * rows, K / 2], tiles [block_n, block_k / 2]
    (launch.tma). TMA wants 16-byte tile rows, row strides and base: block_k >= 32, K / 2 a multiple of 16 bytes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if launch.block_k < 32 or w.shape[-1] % 16 or not w.is_contiguous() or w.data_ptr() % 16:
        raise ValueError(f"MoeLaunch.tma needs block_k >= 32 and contiguous codes with rows of a multiple of 16 bytes, "
                         f"got block_k {launch.block_k} and codes {tuple(w.shape)} stride {w.stride()}")
    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [launch.block_n, launch.block_k // 2])


def _k_splits(k: int, launch: MoeLaunch) -> tuple:
    """(splits, K per split: a multiple of the K tile) for launch.split_k over a K of k (no empty split)."""
    per = triton.cdiv(triton.cdiv(k, max(1, launch.split_k)), launch.block_k) * launch.block_k
    return triton.cdiv(k, per), per


def moe_gate_up(x, rows, block_expert, w13, s13, inter: int, top_k: int, limit: float, block_m: int,
                launch: MoeLaunch, fp8: bool, pdl: bool = False) -> torch.Tensor:
    """Step 2 alone (the benchmark sweep times it): the activated intermediate rows [num_blocks * block_m, I]. Split
    over K, the kernel writes fp32 gate and up sums per split; dsv4_moe_sums.swiglu_splits adds them and applies the
    clamped SwiGLU. pdl (planes launches only): launched as programmatic dependents (dsv4_pdl)."""
    if launch.planes:
        if fp8:
            raise ValueError("MoeLaunch.planes takes MXFP4 weights, not FP8 experts")
        return planes_gate_up(x, rows, block_expert, w13, s13, inter, top_k, limit, block_m, launch, pdl)
    num_blocks, hidden = block_expert.shape[0], x.shape[1]
    splits, per_split = _k_splits(hidden, launch)
    if splits == 1:
        out = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, num_blocks * block_m, 2 * inter, dtype=torch.float32, device=x.device)
    # FP8 scale grids are [E, halves, row blocks, column blocks]; MXFP4 scale bytes [E, rows, inputs / 32] or chunked
    (s13_e, s13_row, chunked), s13_half = ((s13.stride(0), s13.stride(2), False), s13.stride(1)) if fp8 else \
        (scale_layout(s13), 0)
    a_fmt = _scaled_dot_format(launch, x.dtype, fp8)
    w_desc = _codes_descriptor(w13, launch) if launch.tma and a_fmt else None
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, launch.block_n), splits)](
        x, rows, block_expert, w13, w_desc, s13, out, hidden, inter, top_k, w13.shape[0], x.stride(0), w13.stride(0),
        w13.stride(1), s13_e, s13_row, out.stride(-2), s13_half, float(limit), per_split,
        out.stride(0) if splits > 1 else 0, BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        WEIGHT_FP8=fp8, SCALE_BCAST=launch.scale_bcast, PREC=_precision(x.dtype), A_FMT=a_fmt, SPLIT_K=splits,
        TMA=w_desc is not None, SCALE_CHUNKED=chunked, num_warps=launch.num_warps, num_stages=launch.num_stages)
    if splits == 1:
        return out
    return swiglu_splits(out, rows, torch.empty(out.shape[1], inter, dtype=x.dtype, device=x.device), limit)


def moe_down(h, rows, block_expert, w2, s2, topk_weights, hidden: int, block_m: int, launch: MoeLaunch,
             fp8: bool, pdl: bool = False) -> torch.Tensor:
    """Step 3 alone: each (token, slot) pair's weighted expert output [T * k, D] fp32; split over K, one such slice
    per split, [splits, T * k, D] (dsv4_moe_sums.combine_pairs adds them)."""
    num_blocks, inter = block_expert.shape[0], h.shape[1]
    weights = topk_weights.flatten().float().contiguous()
    if launch.planes:
        if fp8:
            raise ValueError("MoeLaunch.planes takes MXFP4 weights, not FP8 experts")
        return planes_down(h, rows, block_expert, w2, s2, weights, hidden, block_m, launch, pdl)
    splits, per_split = _k_splits(inter, launch)
    pairs = torch.empty(splits, weights.numel(), hidden, dtype=torch.float32, device=h.device)
    s2_e, s2_row, chunked = (s2.stride(0), s2.stride(2), False) if fp8 else scale_layout(s2)
    a_fmt = _scaled_dot_format(launch, h.dtype, fp8)
    w_desc = _codes_descriptor(w2, launch) if launch.tma and a_fmt else None
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, launch.block_n), splits)](
        h, rows, block_expert, w2, w_desc, s2, weights, pairs, hidden, inter, w2.shape[0], h.stride(0), w2.stride(0),
        w2.stride(1), s2_e, s2_row, pairs.stride(1), per_split, pairs.stride(0) if splits > 1 else 0,
        BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, WEIGHT_FP8=fp8,
        SCALE_BCAST=launch.scale_bcast, PREC=_precision(h.dtype), A_FMT=a_fmt, TMA=w_desc is not None,
        SCALE_CHUNKED=chunked, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return pairs[0] if splits == 1 else pairs  # combine_pairs adds the splits' slices
