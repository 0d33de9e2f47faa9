"""The fused MXFP4 MoE with FP8 activations (W4A8): DeepSeek-V4's reference function for its routed experts, the
activations quantized per token and 128 inputs with power-of-two scales (the FP8 linears' rule,
dsv4_fp8_gemm.quantize_rows), the codes converted to e4m3 in registers (dsv4_mxfp4_e4m3) and one FP8 MMA per 32-input
scale group: its fp32 sums times the group's scale, each 128 inputs' sums times the activations' scale. The torch
reference is dsv4_moe_mxfp4_ref.fused_moe_mxfp4_ref(fp8_acts=True).

Launches: x quantized (dsv4_fp8_act_quant, stored in group parity order) -> gate-up (the clamped SwiGLU, its output
quantized per 128 by the program that computes those 128 columns; K splits leave fp32 sums for `_swiglu_quant_kernel`)
-> down (router weight applied; one fp32 slice per K split) -> dsv4_moe_sums.combine_pairs. The weights lead the MMA
(acc [BLOCK_N, BLOCK_M]): on sm90 a wgmma with the converted codes in registers and the activations from shared memory
(sm90 compile on the CPU, Triton 3.6: 2.4-2.9 instructions per weight in the decode K loops against the bf16 planes'
3.2-3.5; the scale bytes read one 4-byte word per 4 groups, which takes one layout conversion, through shared memory,
where a byte per group took four). All sums in a fixed order: deterministic. Hidden and intermediate widths must be
multiples of 256 (`check_widths`).

On an H200 it is 1.4-1.9x slower than the W4A16 planes at every batch (RESULTS.md, 2026-12-04 seventh session): each
group's wgmma is waited for before its scale multiplies the partial sums, so a 128-input step is 4-8 MMA round trips
in series; fewer instructions do not make up for it. Opt-in (--mxfp4-moe-precision fp8) for DeepSeek's arithmetic.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant, quantize_rows
from sgl_kernel.dsv4_moe_mxfp4 import MoeConfig, MoeLaunch, dsv4_moe_align, mxfp4_experts_of
from sgl_kernel.dsv4_moe_planes import down_program, k_range
from sgl_kernel.dsv4_moe_sums import clamped_swiglu, combine_pairs
from sgl_kernel.dsv4_mxfp4_e4m3 import E4M3_SHIFT, fp4_group_e4m3, group_multiplier, parity_column
from sgl_kernel.dsv4_mxfp4_planes import planes_supported
from sgl_kernel.dsv4_mxfp4_scales import scale_layout
from sgl_kernel.dsv4_pdl import pdl_enter, pdl_launch, pdl_supported

QBLOCK = 128  # inputs per activation scale
WIDTH_MULTIPLE = 256  # hidden and intermediate widths: every launch's tiles divide them

# Launches by pairs per expert (as moe_config's tiers), the H200 sweep's fastest (RESULTS.md, 2026-12-04 seventh
# session; `benchmark/kernels/sweep_moe_w4a8.py`): 64 x 128 gate-up tiles at every decode size, in 4 K splits up to
# experts / 8 pairs (1-5 tokens of Flash) and 2 beyond (8 tokens: 215 us against 238 unsplit 128-wide; 32 tokens not
# swept); the down 128 x 256 in 2 splits for one token, unsplit for a few, 128 x 128 beyond. Prefill: 64-row blocks
# with 8 warps (the gate-up's fp32 tiles [128, 64]: gate and up, sums and a group's).
A8_GATE_UP_ONE = MoeLaunch(64, 128, 4, 3, scaled_dot=False, split_k=4)
A8_DOWN_ONE = MoeLaunch(128, 256, 4, 3, scaled_dot=False, split_k=2)
A8_GATE_UP_FEW = A8_GATE_UP_ONE
A8_DOWN_FEW = MoeLaunch(128, 256, 4, 3, scaled_dot=False)
A8_GATE_UP = MoeLaunch(64, 128, 4, 3, scaled_dot=False, split_k=2)
A8_DOWN = MoeLaunch(128, 128, 4, 3, scaled_dot=False)
A8_PREFILL = MoeLaunch(128, 128, 8, 3, scaled_dot=False)


def a8_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """The W4A8 launches for a batch of `num_pairs` (token, slot) pairs (static per batch size)."""
    if num_pairs > 16 * num_experts:  # 64-row blocks: 128 would hold 4 fp32 tiles [128, 128] in the gate-up (spills)
        return MoeConfig(64, A8_PREFILL, A8_PREFILL)
    if num_pairs * 32 <= num_experts:
        return MoeConfig(16, A8_GATE_UP_ONE, A8_DOWN_ONE)
    if num_pairs * 8 <= num_experts:
        return MoeConfig(16, A8_GATE_UP_FEW, A8_DOWN_FEW)
    return MoeConfig(16, A8_GATE_UP, A8_DOWN)


def a8_supported(device: torch.device) -> bool:
    """FP8 MMA for the W4A8 kernels: NVIDIA sm90 and later (Hopper's wgmma; older GPUs and ROCm keep W4A16), and
    the CPU interpreter (tests)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def check_widths(hidden: int, inter: int) -> None:
    if hidden % WIDTH_MULTIPLE or inter % WIDTH_MULTIPLE:
        raise ValueError(f"W4A8 experts need hidden ({hidden}) and intermediate ({inter}) sizes that are multiples of "
                         f"{WIDTH_MULTIPLE}")


@triton.jit
def _sum_128(w_rows, a_rows, as_rows, s_e, rows, k, stride_sn, SCALE_CHUNKED: tl.constexpr, PTX: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """[BLOCK_N, BLOCK_M]: weight rows `rows` (codes at w_rows, pointers [BLOCK_N, 16] at input 0) times the
    activations (a_rows [BLOCK_M, 32], group parity order; multipliers at as_rows) over inputs k .. k + 127: per
    32-input group an FP8 MMA times the group's scale, the four groups' sum times the activations' multipliers."""
    s = _scale_word(s_e, rows, k // 32, stride_sn, SCALE_CHUNKED)
    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for j in tl.static_range(4):
        codes = fp4_group_e4m3(tl.load(w_rows + (k // 2 + j * 16)), PTX)
        scale = group_multiplier((s >> (8 * j)) & 0xFF)
        part += tl.dot(codes, tl.trans(tl.load(a_rows + (k + j * 32)))) * scale[:, None]
    return part * (tl.load(as_rows + k // 128) * (2.0 ** E4M3_SHIFT))[None, :]


@triton.jit
def _scale_word(s_e, rows, g0, stride_sn, SCALE_CHUNKED: tl.constexpr):
    """[rows] int32: the scale bytes of groups g0 .. g0 + 3 of each row, group g0 in the low byte (4 consecutive,
    4-byte aligned bytes in either layout: g0 a multiple of 4, rows of a multiple of 8 groups). One word per row: the
    multipliers reach the accumulator's row layout in one conversion per 4 groups, not one per group."""
    if SCALE_CHUNKED:
        off = rows * 8 + (g0 // 8) * stride_sn + g0 % 8
    else:
        off = rows * stride_sn + g0
    return tl.load((s_e + off).to(tl.pointer_type(tl.int32)))


@triton.jit
def _w4a8_gate_up_kernel(x_ptr, xs_ptr, rows_ptr, bexp_ptr, w_ptr, s_ptr, h_ptr, hs_ptr, D, I, TOPK, E, stride_x,
                         stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_h, stride_hs, limit, K_PER_SPLIT,
                         stride_ps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PTX: tl.constexpr, SCALE_CHUNKED: tl.constexpr, SPLITS: tl.constexpr,
                         ROUND_IN_FP32: tl.constexpr, PDL: tl.constexpr):
    """One 16-row block of an expert's pairs x a BLOCK_N tile of the intermediate dim (BLOCK_N = 128 unsplit): gate
    and up sums, the clamped SwiGLU, quantized per row into h (e4m3, group parity order) and hs (multipliers).
    SPLITS > 1: program_id(2)'s K range, its raw gate and up sums into h_ptr [SPLITS, rows, 2I] fp32."""
    pdl_enter(PDL)
    blk = tl.program_id(0)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        tok = tl.where(valid, pair // TOPK, 0).to(tl.int64)
        a_rows = x_ptr + tok[:, None] * stride_x + tl.arange(0, 32)[None, :]
        as_rows = xs_ptr + tok * stride_xs
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        g_rows = w_e + n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, 16)[None, :]
        u_rows = g_rows + I * stride_wn
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        k_lo, k_hi = k_range(D, K_PER_SPLIT, BLOCK_K, SPLITS)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for q in tl.static_range(BLOCK_K // 128):  # gate, then up: one group's partial sums live at a time
                acc_g += _sum_128(g_rows, a_rows, as_rows, s_e, n, k0 + q * 128, stride_sn, SCALE_CHUNKED, PTX,
                                  BLOCK_N, BLOCK_M)
                acc_u += _sum_128(u_rows, a_rows, as_rows, s_e, I + n, k0 + q * 128, stride_sn, SCALE_CHUNKED, PTX,
                                  BLOCK_N, BLOCK_M)
        if SPLITS == 1:
            act = clamped_swiglu(tl.trans(acc_g), tl.trans(acc_u), limit)  # [BLOCK_M, 128]: one quantization block
            q8, scale = quantize_rows(act, 448.0, ROUND_IN_FP32)
            tl.store(h_ptr + r.to(tl.int64)[:, None] * stride_h + parity_column(n)[None, :],
                     q8.to(h_ptr.dtype.element_ty), mask=valid[:, None])
            tl.store(hs_ptr + r.to(tl.int64) * stride_hs + tl.program_id(1), scale, mask=valid)
        else:
            p_rows = (h_ptr + tl.program_id(2).to(tl.int64) * stride_ps + r.to(tl.int64)[None, :] * stride_h
                      + n[:, None])
            tl.store(p_rows, acc_g, mask=valid[None, :])
            tl.store(p_rows + I, acc_u, mask=valid[None, :])


@triton.jit
def _swiglu_quant_kernel(p_ptr, rows_ptr, h_ptr, hs_ptr, I, stride_ps, stride_p, stride_h, stride_hs, limit,
                         SPLITS: tl.constexpr, NB: tl.constexpr, ROUND_IN_FP32: tl.constexpr, PDL: tl.constexpr):
    """h row r, NB 128-column blocks: the clamped SwiGLU of the gate and up sums over the K splits (added in split
    order), quantized per block as the unsplit gate-up does; rows without a pair are skipped."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    if tl.load(rows_ptr + r) >= 0:
        n = tl.program_id(1) * NB * 128 + tl.arange(0, NB * 128)
        row = p_ptr + r.to(tl.int64) * stride_p + n
        g = tl.load(row)
        u = tl.load(row + I)
        for s in tl.static_range(1, SPLITS):
            g += tl.load(row + s * stride_ps)
            u += tl.load(row + s * stride_ps + I)
        q8, scale = quantize_rows(tl.reshape(clamped_swiglu(g, u, limit), [NB, 128]), 448.0, ROUND_IN_FP32)
        tl.store(h_ptr + r.to(tl.int64) * stride_h + parity_column(n), tl.reshape(q8, [NB * 128]).to(
            h_ptr.dtype.element_ty))
        tl.store(hs_ptr + r.to(tl.int64) * stride_hs + tl.program_id(1) * NB + tl.arange(0, NB), scale)


@triton.jit
def _w4a8_down_kernel(h_ptr, hs_ptr, rows_ptr, bexp_ptr, w_ptr, s_ptr, wts_ptr, out_ptr, D, I, E, stride_h,
                      stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_o, K_PER_SPLIT, stride_os,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr,
                      SCALE_CHUNKED: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One block's quantized h rows times a BLOCK_N tile of the expert's w2 rows, times each pair's router weight,
    into the pairs' rows of out; blocks of another rank's experts (E) write zeros there. SPLITS > 1: program_id(2)'s
    K range into out's slice program_id(2) (stride_os)."""
    pdl_enter(PDL)
    out_ptr, e, r, n = down_program(out_ptr, bexp_ptr, stride_os, BLOCK_M, BLOCK_N, SPLITS)
    if e <= E:
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        out_rows = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[None, :] * stride_o + n[:, None]
        if e < E:
            a_rows = h_ptr + r.to(tl.int64)[:, None] * stride_h + tl.arange(0, 32)[None, :]
            as_rows = hs_ptr + r.to(tl.int64) * stride_hs
            w_e = w_ptr + e.to(tl.int64) * stride_we
            s_e = s_ptr + e.to(tl.int64) * stride_se
            w_rows = w_e + n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, 16)[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            k_lo, k_hi = k_range(I, K_PER_SPLIT, BLOCK_K, SPLITS)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                for q in tl.static_range(BLOCK_K // 128):
                    acc += _sum_128(w_rows, a_rows, as_rows, s_e, n, k0 + q * 128, stride_sn, SCALE_CHUNKED, PTX,
                                    BLOCK_N, BLOCK_M)
            wt = tl.load(wts_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
            tl.store(out_rows, acc * wt[None, :], mask=valid[None, :])
        else:
            tl.store(out_rows, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), mask=valid[None, :])


def _ptx(device: torch.device) -> bool:
    """The conversion's inline PTX: NVIDIA GPUs (not ROCm, not the interpreter); else Triton's integer ops."""
    return planes_supported(device, torch.bfloat16)


def _splits(launch: MoeLaunch, k: int) -> int:
    """launch.split_k, or the largest divisor of the K tiles below it (narrow test widths)."""
    tiles = k // launch.block_k
    return max(s for s in range(1, max(1, launch.split_k) + 1) if tiles % s == 0)


def w4a8_gate_up(xq, xs, rows, block_expert, w13, s13, inter: int, top_k: int, limit: float, block_m: int,
                 launch: MoeLaunch, pdl: bool = False) -> tuple:
    """The quantized activated intermediate rows: (e4m3 [num_blocks * block_m, I] in group parity order, fp32
    multipliers [num_blocks * block_m, I / 128]); rows without a pair are left unwritten."""
    num_blocks, hidden = block_expert.shape[0], xq.shape[1]
    splits = _splits(launch, hidden)
    if splits == 1 and launch.block_n != QBLOCK:
        raise ValueError(f"an unsplit W4A8 gate-up quantizes its own 128 columns: block_n must be 128, got "
                         f"{launch.block_n}")
    rows_n = num_blocks * block_m
    hq = torch.empty(rows_n, inter, dtype=torch.float8_e4m3fn, device=xq.device)
    hs = torch.empty(rows_n, inter // QBLOCK, dtype=torch.float32, device=xq.device)
    part = hq if splits == 1 else torch.empty(splits, rows_n, 2 * inter, dtype=torch.float32, device=xq.device)
    s_e, s_major, chunked = scale_layout(s13)
    on_cpu = xq.device.type != "cuda"
    _w4a8_gate_up_kernel[(num_blocks, inter // launch.block_n, splits)](
        xq, xs, rows, block_expert, w13, s13, part, hs, hidden, inter, top_k, w13.shape[0], xq.stride(0), xs.stride(0),
        w13.stride(0), w13.stride(1), s_e, s_major, part.stride(-2), hs.stride(0), float(limit), hidden // splits,
        part.stride(0) if splits > 1 else 0, BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        PTX=_ptx(xq.device), SCALE_CHUNKED=chunked, SPLITS=splits,
        ROUND_IN_FP32=on_cpu, PDL=pdl, num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_launch(pdl))
    if splits > 1:
        nb = math.gcd(8, inter // QBLOCK)
        _swiglu_quant_kernel[(rows_n, inter // (nb * QBLOCK))](
            part, rows, hq, hs, inter, part.stride(0), part.stride(1), hq.stride(0), hs.stride(0), float(limit),
            SPLITS=splits, NB=nb, ROUND_IN_FP32=on_cpu, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return hq, hs


def w4a8_down(hq, hs, rows, block_expert, w2, s2, weights, hidden: int, block_m: int, launch: MoeLaunch,
              pdl: bool = False) -> torch.Tensor:
    """Each pair's weighted expert output [T * k, D] fp32 (weights: the router weights flattened, fp32); with K
    splits one slice per split, [splits, T * k, D] (combine_pairs adds them)."""
    num_blocks, inter = block_expert.shape[0], hq.shape[1]
    splits = _splits(launch, inter)
    out = torch.empty(splits, weights.numel(), hidden, dtype=torch.float32, device=hq.device)
    s_e, s_major, chunked = scale_layout(s2)
    _w4a8_down_kernel[(num_blocks, hidden // launch.block_n, splits)](
        hq, hs, rows, block_expert, w2, s2, weights, out, hidden, inter, w2.shape[0], hq.stride(0), hs.stride(0),
        w2.stride(0), w2.stride(1), s_e, s_major, out.stride(1), inter // splits, out.stride(0), BLOCK_M=block_m,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        PTX=_ptx(hq.device), SCALE_CHUNKED=chunked,
        SPLITS=splits, PDL=pdl, num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_launch(pdl))
    return out[0] if splits == 1 else out


def dsv4_moe_mxfp4_w4a8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                        w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                        config: Optional[MoeConfig] = None) -> torch.Tensor:
    """dsv4_moe_mxfp4 (same arguments and layouts) with FP8 activations: [T, D] in x's dtype. Hidden and
    intermediate sizes multiples of 256; scale bytes as stored (byte 0 reads as a zero multiplier)."""
    inter, (w13, s13, w2, s2) = mxfp4_experts_of(x, w13, w13_scale, w2, w2_scale)
    num_tokens, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    check_widths(hidden, inter)
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or a8_config(num_tokens * top_k, num_experts)
    pdl = cfg.pdl and pdl_supported(x.device)
    rows, block_expert = dsv4_moe_align(topk_ids, num_experts, cfg.block_m, pdl=pdl)
    xq, xs = dsv4_fp8_act_quant(x, parity=True, pdl=pdl)
    hq, hs = w4a8_gate_up(xq, xs, rows, block_expert, w13, s13, inter, top_k, limit, cfg.block_m, cfg.gate_up, pdl)
    weights = topk_weights.flatten().float().contiguous()
    pairs = w4a8_down(hq, hs, rows, block_expert, w2, s2, weights, hidden, cfg.block_m, cfg.down, pdl)
    return combine_pairs(pairs, top_k, x.dtype, pdl)
