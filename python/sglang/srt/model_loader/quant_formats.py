"""Torch helpers for the hub weight formats (docs/dsv4-architecture.md section 8.1).

* E8M0 (`torch.float8_e8m0fnu`): byte b means 2^(b-127); 255 is NaN.
* FP8 e4m3 weights with one E8M0 scale per 128x128 block (edge blocks may be partial).
* MXFP4 routed experts: e2m1 codes packed two per byte (low nibble = even input index),
  one E8M0 scale per 32 consecutive inputs of a row. The e2m1 code <-> value maps are sgl_kernel's
  (dsv4_formats_ref, shared with the FP4 index-key cache rows).

Dequantization is exact: every value is code * 2^e computed in fp32 (a product with a power of
two never rounds unless it underflows), then cast to the requested dtype. Exponents are derived
with frexp, not log2, so a ratio that is exactly a power of two never rounds the wrong way.
"""

from __future__ import annotations

import math

import torch
from sgl_kernel.dsv4_formats_ref import FP4_MAX, FP8_MAX, e2m1_codes, e2m1_values

FP4_BLOCK = 32  # MXFP4: inputs per E8M0 scale
FP8_BLOCK = (128, 128)


# ---- E8M0 -------------------------------------------------------------------------------------
def e8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """E8M0 tensor holding 2^exp (exp clamped to the finite range [-127, 127])."""
    biased = (exp.to(torch.int32) + 127).clamp(0, 254).to(torch.uint8)
    return biased.view(torch.float8_e8m0fnu)


def e8m0_to_exponent(scale: torch.Tensor) -> torch.Tensor:
    """int32 exponents e with scale = 2^e (byte 255 = NaN maps to 128)."""
    return scale.view(torch.uint8).to(torch.int32) - 127


def e8m0_encode(x: torch.Tensor) -> torch.Tensor:
    """Encode positive powers of two exactly; anything else raises."""
    x = x.float()
    mant, exp = torch.frexp(x)
    if not bool(((mant == 0.5) & (x > 0)).all()):
        raise ValueError("e8m0_encode expects positive powers of two")
    return e8m0_from_exponent(exp - 1)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 to fp32 bit-exactly: byte b is the fp32 exponent field (same bias 127)."""
    b = scale.view(torch.uint8).to(torch.int32)
    bits = b << 23
    bits = torch.where(b == 0, torch.full_like(bits, 1 << 22), bits)  # 2^-127 is an fp32 subnormal
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)  # NaN
    return bits.view(torch.float32)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A dequant multiplier as fp32: E8M0 decoded, float scales (HF `weight_scale_inv`) cast."""
    if scale.dtype == torch.float8_e8m0fnu:
        return e8m0_to_float(scale)
    return scale.float()


def pow2_ceil_exponent(ratio: torch.Tensor) -> torch.Tensor:
    """ceil(log2(ratio)) for positive fp32 ratios, exact (frexp gives ratio = m * 2^e, m in [0.5, 1))."""
    mant, exp = torch.frexp(ratio.float())
    return (exp - (mant == 0.5).to(exp.dtype)).to(torch.int32)


# ---- FP8 e4m3 with 128x128 block scales ---------------------------------------------------------
def _block_view(w: torch.Tensor, block: tuple) -> torch.Tensor:
    """Zero-pad [out, in] to whole blocks and view as [ob, bo, ib, bi]."""
    out_f, in_f = w.shape
    bo, bi = block
    ob, ib = math.ceil(out_f / bo), math.ceil(in_f / bi)
    padded = torch.nn.functional.pad(w, (0, ib * bi - in_f, 0, ob * bo - out_f))
    return padded.view(ob, bo, ib, bi)


def expand_block_scale(scale: torch.Tensor, shape: tuple, block: tuple = FP8_BLOCK) -> torch.Tensor:
    """Per-block fp32 multipliers broadcast to a full [out, in] grid."""
    s = scale_to_float(scale)
    s = s.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return s[: shape[0], : shape[1]]


def quantize_fp8_block(w: torch.Tensor, block: tuple = FP8_BLOCK) -> tuple:
    """[out, in] float -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/bo), ceil(in/bi)]).

    scale = 2^ceil(log2(max(amax, 1e-4) / 448)) per block; values are clamped to +-448 before the
    cast so the result never depends on whether the cast saturates.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block expects a 2-D weight, got shape {tuple(w.shape)}")
    w32 = w.float()
    amax = _block_view(w32.abs(), block).amax(dim=(1, 3))
    exp = pow2_ceil_exponent(amax.clamp(min=1e-4) / FP8_MAX).clamp(-127, 127)
    scale = e8m0_from_exponent(exp)
    q = (w32 / expand_block_scale(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8_block(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: tuple = FP8_BLOCK) -> torch.Tensor:
    """Exact fp32 product e4m3 value * block multiplier, then cast to `dtype`."""
    out = w_fp8.float() * expand_block_scale(scale, w_fp8.shape, block)
    return out.to(dtype)


# ---- MXFP4 (e2m1 packed, E8M0 per 32) ----------------------------------------------------------
def quantize_mxfp4(w: torch.Tensor) -> tuple:
    """[out, in] float -> (int8 packed [out, in/2], float8_e8m0fnu [out, in/32]).

    scale = 2^ceil(log2(amax / 6)) per 32 inputs (all-zero blocks get 2^-127), each value rounded
    to the nearest e2m1 code; even input index in the low nibble.
    """
    if w.dim() != 2 or w.shape[1] % FP4_BLOCK:
        raise ValueError(f"quantize_mxfp4 expects [out, in] with in % {FP4_BLOCK} == 0, got {tuple(w.shape)}")
    out_f, in_f = w.shape
    blocks = w.float().view(out_f, in_f // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exp = torch.where(amax > 0, pow2_ceil_exponent(amax / FP4_MAX), torch.full_like(amax, -127, dtype=torch.int32))
    exp = exp.clamp(-127, 127)
    scale = e8m0_from_exponent(exp)
    v = (blocks / e8m0_to_float(scale).unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX).view(out_f, in_f)
    codes = e2m1_codes(v)
    codes = torch.where(codes == 8, 0, codes)  # no -0: a value rounding to zero is code 0 whatever its sign
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [out, in/2] -> uint8 codes [out, in] (low nibble first)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"packed FP4 must be int8 or uint8, got {packed.dtype}")
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1)
    return codes.reshape(b.shape[0], b.shape[1] * 2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact fp32 product e2m1(code) * 2^e per 32-input block, then cast to `dtype`."""
    codes = unpack_fp4_codes(packed)
    values = e2m1_values(codes)
    out_f, in_f = values.shape
    if scale.shape != (out_f, in_f // FP4_BLOCK):
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not match weight [{out_f}, {in_f}] "
                         f"(expected [{out_f}, {in_f // FP4_BLOCK}])")
    mult = scale_to_float(scale).repeat_interleave(FP4_BLOCK, dim=1)
    return (values * mult).to(dtype)
