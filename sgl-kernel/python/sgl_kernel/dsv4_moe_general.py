"""The fused MoE's general gate-up and down kernels: any activation dtype, any widths (masked tiles), MXFP4 or FP8
weights, over the expert blocks of dsv4_moe_align. The door (dsv4_moe) picks them wherever neither the parity planes
(dsv4_moe_planes) nor the GEMVs (dsv4_moe_gemv) run: prefill, activations other than bf16 on an NVIDIA GPU, scale
bytes the caller did not check, FP8 experts, widths the lean kernels' tiles do not divide.

- `_moe_gate_up_kernel`: per block and tile of the intermediate dim, x rows (gathered by token) times the expert's
  w1 and w3 rows, then the clamped SwiGLU silu(min(g, L)) * clamp(u, -L, L), written to an intermediate row per
  padded row.
- `_moe_down_kernel`: the intermediate rows times w2, scaled by the pair's router weight, written to the pair's row
  of a [T*k, D] fp32 buffer (dsv4_moe_sums.combine_pairs sums each token's k rows).
bf16 / fp16 activations with MXFP4 weights go through tl.dot_scaled (the compiler upcasts e2m1 with its e8m0 scales:
native MX MMA where the GPU has one), the codes by pointers or through TMA descriptors (`MoeLaunch.tma`); fp32
activations (GPU oracle runs) and FP8 weights are dequantized in registers (e2m1 code value * 2^(exponent byte - 127),
one scale byte per 32 inputs broadcast over its 16 packed bytes, or e4m3 * block multiplier). Packed bytes hold
inputs 2j (low nibble) and 2j + 1 (high nibble) (the OCP order tl.dot_scaled reads); the in-register path multiplies
the even and the odd input columns of the activations by the two nibble planes. Scale bytes come row-major or
chunked (dsv4_mxfp4_scales), the layout a constexpr. The kernels run over all of K in one program: K splits lost at
every decode size measured, tying one token's down at best (RESULTS.md, "Fused MXFP4 MoE decode: K splits,
multiply-adds and per-group MMAs all lose to the scaled dot", 2026-12-02).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_moe_common import MoeLaunch, block_and_tile, block_major_grid, e2m1_value
from sgl_kernel.dsv4_moe_sums import clamped_swiglu
from sgl_kernel.dsv4_mxfp4_scales import scale_layout, scale_offsets
from sgl_kernel.dsv4_target import dot_precision


@triton.jit
def _fp4_tile(w_ptr, s_ptr, rows, row_ok, k0, K, stride_wn, stride_sn, SCALE_CHUNKED: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dequantized even-input and odd-input planes [BLOCK_N, BLOCK_K / 2] of weight rows `rows` at inputs
    k0 .. k0 + BLOCK_K: one scale byte loaded per 32 inputs and broadcast over its 16 packed bytes (one load per
    packed byte was 2.8-5x slower at every shape: RESULTS.md, "Fused MXFP4 MoE on an H200", 2026-12-02)."""
    col = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ok = row_ok[:, None] & (col < K // 2)[None, :]
    b = tl.load(w_ptr + rows[:, None] * stride_wn + col[None, :], mask=ok, other=0).to(tl.int32)
    gi = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(s_ptr + scale_offsets(rows, gi, stride_sn, SCALE_CHUNKED),
                mask=row_ok[:, None] & (gi < K // 32)[None, :], other=127).to(tl.int32)
    mult = (s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
    mult = tl.reshape(tl.broadcast_to(mult[:, :, None], [BLOCK_N, BLOCK_K // 32, 16]), [BLOCK_N, BLOCK_K // 2])
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
                        stride_wn, stride_se, stride_sn, stride_h, stride_shalf, limit, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHT_FP8: tl.constexpr, PREC: tl.constexpr,
                        A_FMT: tl.constexpr, TMA: tl.constexpr, SCALE_CHUNKED: tl.constexpr):
    """One block x one BLOCK_N tile of the intermediate dim, over all of D (K tiles from 0: the compiler knows each
    tile's chunked scale bytes contiguous). TMA: the scaled dot's weight codes through `w_desc` (_fp4_packed)."""
    blk, tile = block_and_tile(I, BLOCK_N)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        tok = tl.where(valid, pair // TOPK, 0)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        j = tl.arange(0, BLOCK_K // 2)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            if A_FMT != "":  # 16-bit activations, e2m1 weights: the compiler's scaled dot
                xk = _x_rows(x_ptr, tok, valid, stride_x, k0, D, BLOCK_K)
                first = e * 2 * I + tile * BLOCK_N  # w13's gate rows of this tile, all experts' rows
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
                g_lo, g_hi = _fp4_tile(w_e, s_e, n, n_ok, k0, D, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_N, BLOCK_K)
                u_lo, u_hi = _fp4_tile(w_e, s_e, I + n, n_ok, k0, D, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_N,
                                       BLOCK_K)
                dt = x_even.dtype
                acc_g += tl.dot(x_even, tl.trans(g_lo.to(dt)), out_dtype=tl.float32, input_precision=PREC)
                acc_g += tl.dot(x_odd, tl.trans(g_hi.to(dt)), out_dtype=tl.float32, input_precision=PREC)
                acc_u += tl.dot(x_even, tl.trans(u_lo.to(dt)), out_dtype=tl.float32, input_precision=PREC)
                acc_u += tl.dot(x_odd, tl.trans(u_hi.to(dt)), out_dtype=tl.float32, input_precision=PREC)
        act = clamped_swiglu(acc_g, acc_u, limit)
        h_rows = h_ptr + r.to(tl.int64)[:, None] * stride_h + n[None, :]
        tl.store(h_rows, act.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, rows_ptr, bexp_ptr, w_ptr, w_desc, s_ptr, wts_ptr, out_ptr, D, I, E, stride_h, stride_we,
                     stride_wn, stride_se, stride_sn, stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, WEIGHT_FP8: tl.constexpr, PREC: tl.constexpr, A_FMT: tl.constexpr,
                     TMA: tl.constexpr, SCALE_CHUNKED: tl.constexpr):
    """One block x one BLOCK_N tile of the outputs, over all of I: the pairs' weighted rows; blocks of another rank's
    experts (E) write zeros there."""
    blk, tile = block_and_tile(D, BLOCK_N)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < D
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        j = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            if A_FMT != "":
                hk = _x_rows(h_ptr, r, valid, stride_h, k0, I, BLOCK_K)
                wb, sb = _fp4_packed(w_e, s_e, n, n_ok, k0, I, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_K, w_desc,
                                     e * D + tile * BLOCK_N, TMA)
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
                lo, hi = _fp4_tile(w_e, s_e, n, n_ok, k0, I, stride_wn, stride_sn, SCALE_CHUNKED, BLOCK_N, BLOCK_K)
                acc += tl.dot(h_even, tl.trans(lo.to(h_even.dtype)), out_dtype=tl.float32, input_precision=PREC)
                acc += tl.dot(h_odd, tl.trans(hi.to(h_even.dtype)), out_dtype=tl.float32, input_precision=PREC)
        wt = tl.load(wts_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
        out_rows = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_o + n[None, :]
        tl.store(out_rows, acc * wt[:, None], mask=valid[:, None] & n_ok[None, :])
    elif e == E:  # pairs of another rank's experts: their rows of the pair buffer are 0
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        out_rows = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_o + n[None, :]
        tl.store(out_rows, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=valid[:, None] & (n < D)[None, :])


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


def dequant_shared_bytes(block_m: int, launch: MoeLaunch, act_bytes: int, fp8: bool, weight_tiles: int,
                         arch: Optional[int] = None) -> int:
    """Shared memory the in-register dequantization's kernel takes on an NVIDIA GPU (`weight_tiles`: 2 for the
    gate-up, 1 for the down): the pipeliner holds num_stages - 1 copies of each K step's loads (the activation tile;
    the weight codes; FP8's 128x128 multipliers, loaded as a full fp32 tile per weight tile, the largest part; MXFP4's
    scale bytes) and the dot's weight operands sit in shared memory once, at the activations' width. Calibrated on
    sm90 compiles of the engine's tiles at 2 and 3 stages (python -m sgl_kernel.aot_check): within 1 KiB of the
    compiler's number for fp32 activations (FP8 decode gate-up 16 x 32 x 256: 256 / 160 KiB at 3 / 2 stages), 16 KiB
    low to 32 KiB high for bf16 ones (FP8 weights). On sm100 (`arch` 100 and up: the NVIDIA compute capability x10)
    Triton 3.6 holds FP8's fp32 multiplier tile once more with fp32 activations: the prefill gate-up 128 x 64 x 128 at
    2 stages took 278,560 B there (python -m sgl_kernel.aot_check --target sm100 on a GPU machine), this estimate's
    sm90 figure plus that tile (and a 32 B barrier)."""
    n, k = launch.block_n * weight_tiles, launch.block_k
    codes = n * k if fp8 else n * k // 2 + n * k // 32
    scales = n * k * 4 if fp8 else 0
    loads = block_m * k * act_bytes + codes + scales
    extra = scales if arch is not None and arch >= 100 and act_bytes == 4 else 0
    return (launch.num_stages - 1) * loads + n * k * act_bytes + extra


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


def general_gate_up(x, rows, block_expert, w13, s13, inter: int, top_k: int, limit: float, block_m: int,
                    launch: MoeLaunch, fp8: bool) -> torch.Tensor:
    """Step 2 on the general kernel: the activated intermediate rows [num_blocks * block_m, I] (rows without a pair
    unwritten). w13 / s13: MXFP4 codes and scale bytes (dsv4_moe.dsv4_moe_mxfp4's layouts) or, with fp8, e4m3 rows
    and their [E, 2, I/128, D/128] block grid (dsv4_moe.dsv4_moe_fp8's)."""
    num_blocks, hidden = block_expert.shape[0], x.shape[1]
    out = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    # FP8 scale grids are [E, halves, row blocks, column blocks]; MXFP4 scale bytes [E, rows, inputs / 32] or chunked
    (s13_e, s13_row, chunked), s13_half = ((s13.stride(0), s13.stride(2), False), s13.stride(1)) if fp8 else \
        (scale_layout(s13), 0)
    a_fmt = _scaled_dot_format(launch, x.dtype, fp8)
    w_desc = _codes_descriptor(w13, launch) if launch.tma and a_fmt else None
    _moe_gate_up_kernel[block_major_grid(num_blocks, inter, launch.block_n)](
        x, rows, block_expert, w13, w_desc, s13, out, hidden, inter, top_k, w13.shape[0], x.stride(0), w13.stride(0),
        w13.stride(1), s13_e, s13_row, out.stride(0), s13_half, float(limit), BLOCK_M=block_m, BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, WEIGHT_FP8=fp8, PREC=dot_precision(x.dtype, x.device), A_FMT=a_fmt,
        TMA=w_desc is not None, SCALE_CHUNKED=chunked, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out


def general_down(h, rows, block_expert, w2, s2, weights, hidden: int, block_m: int, launch: MoeLaunch,
                 fp8: bool) -> torch.Tensor:
    """Step 3 on the general kernel: each (token, slot) pair's weighted expert output [T * k, D] fp32 (weights: the
    router weights flattened, fp32)."""
    num_blocks, inter = block_expert.shape[0], h.shape[1]
    pairs = torch.empty(weights.numel(), hidden, dtype=torch.float32, device=h.device)
    s2_e, s2_row, chunked = (s2.stride(0), s2.stride(2), False) if fp8 else scale_layout(s2)
    a_fmt = _scaled_dot_format(launch, h.dtype, fp8)
    w_desc = _codes_descriptor(w2, launch) if launch.tma and a_fmt else None
    _moe_down_kernel[block_major_grid(num_blocks, hidden, launch.block_n)](
        h, rows, block_expert, w2, w_desc, s2, weights, pairs, hidden, inter, w2.shape[0], h.stride(0), w2.stride(0),
        w2.stride(1), s2_e, s2_row, pairs.stride(0), BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        WEIGHT_FP8=fp8, PREC=dot_precision(h.dtype, h.device), A_FMT=a_fmt, TMA=w_desc is not None,
        SCALE_CHUNKED=chunked, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return pairs
