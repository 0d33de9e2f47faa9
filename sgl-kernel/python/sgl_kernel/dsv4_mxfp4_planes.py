"""MXFP4 weight tiles as two 16-bit planes for the fused MoE's decode launches (dsv4_moe_mxfp4, MoeLaunch.planes).

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
"""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_kernel.dsv4_mxfp4_scales import scale_offsets

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
def e2m1_value(code):
    """e2m1 codes (int32, 0..15) -> fp32 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 (bit 3 the sign), exactly: the code's sign,
    exponent and mantissa bits placed in an fp16 (sign at 15, exponent at 10-11, mantissa at 9) are the value times
    2^-14 (e = 0 lands on fp16 subnormals, which hold 0.5 * 2^-14 exactly); no table, no branches."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


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


def planes_supported(device, dtype) -> bool:
    """The PTX planes: NVIDIA GPUs (not ROCm, not the CPU interpreter) with bf16 activations."""
    import torch

    return device.type == "cuda" and torch.version.hip is None and dtype == torch.bfloat16 and not _interpreting()


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"

