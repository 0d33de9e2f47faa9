"""dsv4_rms_norm: RMSNorm over the last dim in one launch, fp32 math, result in x's dtype.

    y = x / sqrt(mean(x^2) + eps) [* weight]

The same arithmetic as the engine's torch path (sglang.srt.layers.norm, its reference): the row is read once in
fp32, the weight is applied in fp32, and the result is cast back once. The torch path costs about eight launches
per call (casts, square, mean, rsqrt, products); DeepSeek-V4 runs several norms per layer per step.

dsv4_rms_norm_fp8 also writes the result quantized for an FP8 W8A8 linear that reads it (per row and 128 channels,
dsv4_fp8_gemm.quantize_rows, of the result as rounded to x's dtype: the codes norm + dsv4_fp8_act_quant give), so
that linear's activation quantization, a launch that reads the whole row again, is saved.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_fp8_gemm import fp8_act_buffers, quantize_rows
from sgl_kernel.dsv4_fp8_gemm_ref import BLOCK, fp8_max


@triton.jit
def round_to(y, ty, BF16_BITS: tl.constexpr):
    """fp32 -> ty, rounded to nearest even. BF16_BITS (the CPU interpreter, whose bf16 cast truncates): the rounding
    done on y's bits first, so that the cast only drops zeros."""
    if BF16_BITS:
        bits = y.to(tl.int32, bitcast=True)
        y = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return y.to(ty)


@triton.jit(do_not_specialize=["stride_q8"])
def _dsv4_rms_norm_kernel(x_ptr, w_ptr, out_ptr, q_ptr, s_ptr, D, stride_x, stride_o, stride_q8, stride_s,
                          stride_sc, eps, HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                          FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """One row. QUANT: also its e4m3 codes (q_ptr, rows 8 * stride_q8 apart) and per-128-channel multipliers (s_ptr,
    strides stride_s per row, stride_sc per block) of the result as stored (D a multiple of 128).

    The codes' row stride is known to the compiler as a multiple of 8 only (not specialized to 16): the FP8 store then
    takes 8-byte vectors, 8 elements per thread like the bf16 loads and stores, so both variants compile the row to
    one layout and sum the squares in one order (a 16-aligned FP8 store pulled the quantizing variant to 16 per
    thread: other sums, outputs no longer bit-equal to norm + act_quant)."""
    stride_q = stride_q8 * 8
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * inv
    if HAS_WEIGHT:
        y = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * y
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if QUANT:
        q, scale = quantize_rows(tl.reshape(y.to(tl.float32), [BLOCK_D // 128, 128]), FP8_MAX, ROUND_IN_FP32)
        tl.store(q_ptr + row * stride_q + cols, tl.reshape(q, [BLOCK_D]).to(q_ptr.dtype.element_ty), mask=mask)
        blocks = tl.arange(0, BLOCK_D // 128)
        tl.store(s_ptr + row * stride_s + blocks * stride_sc, scale, mask=blocks * 128 < D)


def _check(x: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    d = x.shape[-1]
    assert x.stride(-1) == 1, "x: the last dim must be contiguous"
    assert weight is None or (weight.shape == (d,) and weight.is_contiguous()), f"weight must be [{d}] contiguous"
    return x.reshape(-1, d)  # a view for the usual layouts (token-major, heads inside)


def norm_warps(block: int) -> int:
    """Warps for a row of `block` (a power of two) elements: 8 per thread up to 8 warps (H200, 4,096 wide: 8 warps
    10-14% faster than 16 at prefill rows). Both variants must compile to one row layout (the kernel's note;
    compiled for sm90 by test_fp8_variant_has_the_plain_layout)."""
    return max(1, min(8, block // 256))


def _launch(rows, weight, out, q, s, eps: float) -> None:
    d = rows.shape[1]
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        quant = q is not None
        _dsv4_rms_norm_kernel[(rows.shape[0],)](
            rows, weight if weight is not None else rows, out, q if quant else out, s if quant else out, d,
            rows.stride(0), out.stride(0), q.stride(0) // 8 if quant else 0, s.stride(0) if quant else 0,
            s.stride(1) if quant else 0, eps, HAS_WEIGHT=weight is not None, BLOCK_D=block, QUANT=quant,
            FP8_MAX=fp8_max(q.dtype) if quant else 448.0, ROUND_IN_FP32=rows.device.type != "cuda",
            num_warps=norm_warps(block))


def dsv4_rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """x [..., D] (last dim contiguous) -> RMSNorm(x) [..., D] in x.dtype; weight [D] or None."""
    rows = _check(x, weight)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch(rows, weight, out, None, None, eps)
    return out.view(x.shape)


def dsv4_rms_norm_fp8(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                      cublas_layout: bool = False, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple:
    """x [M, D] (D a multiple of 128) -> (RMSNorm(x) [M, D] in x.dtype, its e4m3 codes in fp8_dtype (the FP8
    weight's), its multipliers [M, D / 128]): the codes and multipliers are dsv4_fp8_act_quant(RMSNorm(x),
    cublas_layout=cublas_layout, dtype=fp8_dtype)'s."""
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"x must be [M, D] with D a multiple of {BLOCK}, got {tuple(x.shape)}")
    rows = _check(x, weight)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    q, s = fp8_act_buffers(rows.shape[0], rows.shape[1], rows.shape[1] // BLOCK, cublas_layout, x.device, fp8_dtype)
    _launch(rows, weight, out, q, s, eps)
    return out, q, s
