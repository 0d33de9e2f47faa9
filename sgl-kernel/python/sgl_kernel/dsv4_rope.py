"""dsv4_rope: DeepSeek-V4's interleaved partial RoPE (or its inverse) in one launch.

For x [T, ..., D] and the rotary slice r = x[..., D - R:], pairs (r[2i], r[2i+1]) rotate by angle pos_t * inv_freq[i]
(the negative angle when `inverse`, used to de-rotate the attention output); the first D - R dims are copied.
cos / sin are computed in the kernel from the positions (fp32 angle pos * inv_freq, as the torch path does), so one
launch replaces the torch path's dozen (sglang.srt.layers.rotary, the reference). The result is a new tensor.

dsv4_rope_fp8 writes the result only quantized, for the FP8 W8A8 linear that reads it (the attention output before
the grouped wo_a): per row and 128 channels (dsv4_fp8_gemm.quantize_rows) of the result as rounded to x's dtype,
the codes dsv4_rope + dsv4_fp8_act_quant give, without writing and reading back the 16-bit result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_fp8_gemm import fp8_act_buffers, fp8_block_scale, fp8_codes
from sgl_kernel.dsv4_fp8_gemm_ref import BLOCK, fp8_max


@triton.jit
def _rotated_pairs(src, t, pos_ptr, inv_ptr, sign, NOPE, HALF_R: tl.constexpr, BLOCK_R: tl.constexpr, ty):
    """The rope pairs of one head (at src + NOPE) of row t rotated by +-angle (`sign`), rounded to `ty`: (even
    outputs, odd outputs, pair index, pair mask). One function for dsv4_rope and dsv4_rope_fp8, so they agree."""
    i = tl.arange(0, BLOCK_R)
    mask = i < HALF_R
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + i, mask=mask, other=0.0)
    cos = tl.cos(angle)
    sin = tl.sin(angle) * sign
    even = tl.load(src + NOPE + 2 * i, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + NOPE + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    return (even * cos - odd * sin).to(ty), (even * sin + odd * cos).to(ty), i, mask


@triton.jit
def _dsv4_rope_kernel(x_ptr, pos_ptr, inv_ptr, out_ptr, HF, stride_xt, stride_xh, stride_ot, stride_oh, sign,
                      NOPE: tl.constexpr, HALF_R: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    t = (pid // HF).to(tl.int64)
    h = (pid % HF).to(tl.int64)
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = out_ptr + t * stride_ot + h * stride_oh
    if NOPE > 0:
        c = tl.arange(0, BLOCK_NOPE)
        tl.store(dst + c, tl.load(src + c, mask=c < NOPE), mask=c < NOPE)
    re, ro, i, mask = _rotated_pairs(src, t, pos_ptr, inv_ptr, sign, NOPE, HALF_R, BLOCK_R, out_ptr.dtype.element_ty)
    tl.store(dst + NOPE + 2 * i, re, mask=mask)
    tl.store(dst + NOPE + 2 * i + 1, ro, mask=mask)


def dsv4_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., D] (last dim contiguous), positions [T], inv_freq [R/2] fp32 -> x with its last R dims rotated."""
    half = inv_freq.numel()
    d = x.shape[-1]
    assert x.dim() >= 2 and x.stride(-1) == 1 and 2 * half <= d, \
        f"x must be [T, ..., D >= {2 * half}] with a contiguous last dim, got {tuple(x.shape)}"
    assert positions.shape == (x.shape[0],), f"positions must be [{x.shape[0]}], got {tuple(positions.shape)}"
    hf = 1
    for n in x.shape[1:-1]:
        hf *= n
    x3 = x.reshape(x.shape[0], hf, d)
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    t = x3.shape[0]
    if t * hf:
        nope = d - 2 * half
        _dsv4_rope_kernel[(t * hf,)](
            x3, positions, inv_freq.float().contiguous(), out, hf, x3.stride(0), x3.stride(1), out.stride(0),
            out.stride(1), -1.0 if inverse else 1.0, NOPE=nope, HALF_R=half,
            BLOCK_NOPE=triton.next_power_of_2(max(nope, 1)), BLOCK_R=triton.next_power_of_2(half), num_warps=1)
    return out.view(x.shape)


@triton.jit
def _dsv4_rope_fp8_kernel(x_ptr, pos_ptr, inv_ptr, q_ptr, s_ptr, HF, stride_xt, stride_xh, stride_q, stride_s,
                          stride_sc, sign, NB: tl.constexpr, BLOCK_NB: tl.constexpr, HALF_R: tl.constexpr,
                          BLOCK_R: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """One head of one row: its NB 128-channel blocks, the last ending in the rope pairs (rotated as dsv4_rope rotates
    them, rounded to x's dtype); each block's multiplier from its amax over the plain and the rotated values."""
    pid = tl.program_id(0)
    t = (pid // HF).to(tl.int64)
    h = (pid % HF).to(tl.int64)
    src = x_ptr + t * stride_xt + h * stride_xh
    d = NB * 128
    nope = d - 2 * HALF_R
    blk = tl.arange(0, BLOCK_NB)
    col = blk[:, None] * 128 + tl.arange(0, 128)[None, :]  # the head's columns, as [block, 128]
    plain_ok = col < nope
    xn = tl.load(src + col, mask=plain_ok, other=0.0).to(tl.float32)
    re, ro, i, r_ok = _rotated_pairs(src, t, pos_ptr, inv_ptr, sign, nope, HALF_R, BLOCK_R, x_ptr.dtype.element_ty)
    re, ro = re.to(tl.float32), ro.to(tl.float32)  # dsv4_rope's values, rounded to x's dtype
    rope_amax = tl.maximum(tl.max(tl.abs(re), axis=0), tl.max(tl.abs(ro), axis=0))
    amax = tl.max(tl.abs(xn), axis=1)
    amax = tl.where(blk == NB - 1, tl.maximum(amax, rope_amax), amax)  # the pairs sit in the last block
    scale, inv = fp8_block_scale(amax, FP8_MAX)
    inv_last = tl.sum(tl.where(blk == NB - 1, inv, 0.0), axis=0)
    dst = q_ptr + t * stride_q + h * d
    qt = q_ptr.dtype.element_ty
    tl.store(dst + col, fp8_codes(xn, inv[:, None], FP8_MAX, ROUND_IN_FP32).to(qt), mask=plain_ok)
    tl.store(dst + nope + 2 * i, fp8_codes(re, inv_last, FP8_MAX, ROUND_IN_FP32).to(qt), mask=r_ok)
    tl.store(dst + nope + 2 * i + 1, fp8_codes(ro, inv_last, FP8_MAX, ROUND_IN_FP32).to(qt), mask=r_ok)
    tl.store(s_ptr + t * stride_s + (h * NB + blk) * stride_sc, scale, mask=blk < NB)


def rope_fp8_supported(x: torch.Tensor, rope_dim: int) -> bool:
    """dsv4_rope_fp8 covers x [T, H, D]: D a multiple of 128 with the rope dims inside each head's last 128-block
    (DeepSeek-V4: D 512, rope 64), the last dim contiguous."""
    return (x.dim() == 3 and x.shape[2] % BLOCK == 0 and 0 < rope_dim <= BLOCK and rope_dim % 2 == 0
            and x.stride(2) == 1)


def dsv4_rope_fp8(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
                  cublas_layout: bool = False, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple:
    """x [T, H, D] (rope_fp8_supported) -> (e4m3 [T, H * D] in fp8_dtype, fp32 multipliers [T, H * D / 128]) of
    dsv4_rope(x, ...).flatten(1), quantized as dsv4_fp8_act_quant(..., cublas_layout, dtype=fp8_dtype) does."""
    half = inv_freq.numel()
    if not rope_fp8_supported(x, 2 * half):
        raise ValueError(f"x must be [T, H, D] with D a multiple of {BLOCK}, {2 * half} rope dims inside the last "
                         f"{BLOCK} and a contiguous last dim, got {tuple(x.shape)} stride {x.stride()}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions must be [{x.shape[0]}], got {tuple(positions.shape)}")
    t, heads, d = x.shape
    q, s = fp8_act_buffers(t, heads * d, heads * d // BLOCK, cublas_layout, x.device, fp8_dtype)
    if t * heads:
        _dsv4_rope_fp8_kernel[(t * heads,)](
            x, positions, inv_freq.float().contiguous(), q, s, heads, x.stride(0), x.stride(1), q.stride(0),
            s.stride(0), s.stride(1), -1.0 if inverse else 1.0, NB=d // BLOCK,
            BLOCK_NB=triton.next_power_of_2(d // BLOCK), HALF_R=half, BLOCK_R=triton.next_power_of_2(half),
            FP8_MAX=fp8_max(q.dtype), ROUND_IN_FP32=x.device.type != "cuda", num_warps=1 if d <= 512 else 4)
    return q, s
