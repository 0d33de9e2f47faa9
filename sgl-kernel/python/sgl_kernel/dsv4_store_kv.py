"""dsv4_store_kv: write DeepSeek-V4 main-KV entries (window or compressed) into a cache by slot.

    cache[slots[n]] = encode(values[n])                       for every n with slots[n] >= 0

Two encodings, chosen by `fp8_rope_dim` (docs/dsv4-architecture.md 5.2 and 9.4):

* dense (`fp8_rope_dim == 0`): the cache's dtype as-is, a cast copy (round to nearest even).
* FP8 "MODEL1_FP8Sparse" (`fp8_rope_dim = R > 0`), one uint8 row per entry:
  `[nope e4m3 (D-R bytes) | rope bf16 (2R bytes) | one ue8m0 scale byte per 64 nope values | zero pad to 8]`
  (584 bytes for D=512, R=64). Per 64-block of nope values x:
  `e = ceil(log2(max(amax|x|, 1e-4) / 448))` clamped to [-126, 126], `q = e4m3_rne(clamp(x * 2^-e, +-448))`,
  scale byte `127 + e`; the rope values are rounded to bf16.

Byte-identical to `dsv4_store_kv_ref` (dsv4_attention_ref.py), which encodes through the one definition of the
row layouts (dsv4_formats_ref.py; the engine's `Fp8KVFormat` / `DenseFormat` store through it too).
Everything is computed exactly in integer / fp32 arithmetic so CPU (interpreter) and GPU agree bit for bit:
the exponent from the fp32 bits (`e = E - 126 - 9 + (mantissa > 0.75)`, since 448 = 0.875 * 2^9, which is
the frexp form of `ceil(log2(amax / 448))` with no division or log), 2^-e built from exponent bits, and the
e4m3 / bf16 round-to-nearest-even done on the integer bits (the interpreter's float8/bf16 casts truncate, and
e4m3 hardware casts need sm_89+).

Grid: one program per row (N programs); each reads D values and writes one row. Bytes moved:
N * (D * values.itemsize + row_bytes + slots.itemsize).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_attention_ref import check_store_kv_args, dsv4_store_kv_ref
from sgl_kernel.dsv4_formats_ref import FP8_KV_AMAX_FLOOR, FP8_KV_BLOCK, FP8_MAX, fp8_kv_row_bytes

_E_MIN, _E_MAX = -126, 126  # 2^e and 2^-e both normal fp32
_QMAX_MANT, _QMAX_EXP = math.frexp(FP8_MAX)  # 448 = 0.875 * 2^9
# frexp mantissa m = (1 + f) / 2 > 0.875  <=>  fp32 mantissa bits f * 2^23 > (2 * 0.875 - 1) * 2^23
_QMAX_MANT_BITS = int((2 * _QMAX_MANT - 1) * (1 << 23))
# the same numbers as constexprs for the kernels (jit code may only read constexpr globals)
_FP8_MAX_C = tl.constexpr(FP8_MAX)
_AMAX_FLOOR_C = tl.constexpr(FP8_KV_AMAX_FLOOR)
_QMAX_EXP_C = tl.constexpr(_QMAX_EXP)
_QMAX_MANT_BITS_C = tl.constexpr(_QMAX_MANT_BITS)
_E_MIN_C, _E_MAX_C = tl.constexpr(_E_MIN), tl.constexpr(_E_MAX)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern (int32 whose low 16 bits are the code), round to nearest even (finite x)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _e4m3_bits(x):
    """fp32 with |x| <= 448 -> float8_e4m3fn code (int32 in 0..255), round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal range (|x| >= 2^-6): round 23 -> 3 mantissa bits (a carry bumps the exponent), rebias 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range (codes 0..8 = multiples of 2^-9): |x| * 2^9 = mant * 2^(E - 141), rounded to even
    shift = tl.minimum(141 - (mag >> 23), 31)  # >= 21 here; 31 flushes fp32 zeros/subnormals to 0
    mant = (mag & 0x7FFFFF) | 0x800000
    q = mant >> shift
    rem = mant - (q << shift)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return tl.where(mag < 0x3C800000, sub, normal) | sign


@triton.jit
def _ue8m0_exponent(amax):
    """Exact ceil(log2(amax / 448)) for positive normal fp32 amax, clamped to [-126, 126] (int32)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 126 - _QMAX_EXP_C + ((bits & 0x7FFFFF) > _QMAX_MANT_BITS_C).to(tl.int32)
    return tl.minimum(tl.maximum(e, _E_MIN_C), _E_MAX_C)


@triton.jit
def _dsv4_store_kv_kernel(
    cache_ptr, slots_ptr, values_ptr, values_stride,
    D: tl.constexpr, ROPE: tl.constexpr, ROW: tl.constexpr, D_PAD: tl.constexpr,
    NB_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, DENSE_BF16: tl.constexpr,
):
    n = tl.program_id(0)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    src = values_ptr + n.to(tl.int64) * values_stride
    dst = cache_ptr + slot * ROW
    if slot >= 0:
        if ROPE == 0:  # dense: cast copy
            cols = tl.arange(0, D_PAD)
            x = tl.load(src + cols, mask=cols < D, other=0.0).to(tl.float32)
            if DENSE_BF16:
                y = _bf16_bits(x).to(tl.int16).to(tl.bfloat16, bitcast=True)
            else:
                y = x.to(dst.dtype.element_ty)
            tl.store(dst + cols, y, mask=cols < D)
        else:
            NOPE = D - ROPE
            NB = NOPE // 64
            SCALE_OFF = NOPE + 2 * ROPE
            # nope: [NB_PAD, 64] blocks, one ue8m0 scale each
            blk = tl.arange(0, NB_PAD)
            cols = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
            bmask = blk < NB
            x = tl.load(src + cols, mask=bmask[:, None], other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR_C)
            e = _ue8m0_exponent(amax)
            inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
            y = tl.minimum(tl.maximum(x * inv_scale[:, None], -_FP8_MAX_C), _FP8_MAX_C)
            tl.store(dst + cols, _e4m3_bits(y).to(tl.uint8), mask=bmask[:, None])
            tl.store(dst + SCALE_OFF + blk, (e + 127).to(tl.uint8), mask=bmask)
            # rope: bf16 bits at byte offset NOPE
            r = tl.arange(0, ROPE_PAD)
            xr = tl.load(src + NOPE + r, mask=r < ROPE, other=0.0).to(tl.float32)
            rope_dst = (dst + NOPE).to(tl.pointer_type(tl.int16))
            tl.store(rope_dst + r, _bf16_bits(xr).to(tl.int16), mask=r < ROPE)
            # zero pad up to the 8-byte row boundary
            p = tl.arange(0, 8)
            pad_start = SCALE_OFF + NB
            tl.store(dst + pad_start + p, tl.zeros([8], dtype=tl.uint8), mask=p < ROW - pad_start)


# ----------------------------------------------------------------------------- wrapper


def dsv4_store_kv(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, fp8_rope_dim: int = 0) -> None:
    """Encode `values` [N, D] and write them to rows `slots` [N] of `cache` (rows with slot < 0 are skipped).

    cache: dense [S, D] (float32/bfloat16/float16) when fp8_rope_dim == 0, else uint8 [S, fp8_kv_row_bytes(D, R)].
    """
    check_store_kv_args(cache, slots, values, fp8_rope_dim)
    n, d = values.shape
    if n == 0:
        return
    rope = fp8_rope_dim if fp8_rope_dim > 0 else 0
    nope_blocks = (d - rope) // FP8_KV_BLOCK if rope else 1
    _dsv4_store_kv_kernel[(n,)](
        cache, slots, values, values.stride(0),
        D=d, ROPE=rope, ROW=cache.shape[1], D_PAD=triton.next_power_of_2(d),
        NB_PAD=triton.next_power_of_2(nope_blocks), ROPE_PAD=triton.next_power_of_2(max(rope, 1)),
        DENSE_BF16=cache.dtype == torch.bfloat16, num_warps=4 if d >= 256 else 2,
    )


__all__ = ["dsv4_store_kv", "dsv4_store_kv_ref", "fp8_kv_row_bytes"]
