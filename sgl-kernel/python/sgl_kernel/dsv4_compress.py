"""dsv4_compress: one fused pass from staged compressor rows to a stored DeepSeek-V4 compressed entry.

DeepSeek-V4 compressor (docs/dsv4-architecture.md 5.4, 5.5, 9.2, 9.4). Every source row r of the virtual
concatenation [ring; fresh] holds (x_r, z_r): content and gate logit (slot bias `ape` already added), C channels.
For each new entry n, with S source slots (rows source_rows[n, s], -1 = empty) and head_dim d:

    h_s       = d if (overlap and s >= ratio) else 0        CSA: slots [0, m) take the A half, [m, 2m) the B half
    pooled[c] = sum_s softmax_s(z_{r_s}[h_s + c]) * x_{r_s}[h_s + c]        channel-wise softmax, empty slot: -inf
    y         = round_t(pooled)                              the engine casts to the model dtype t first
    y         = round_t(w * (y * rsqrt(mean(y^2) + eps)))    RMSNorm
    (y_2i, y_2i+1) of the trailing R dims rotated by positions[n] * inv_freq[i], round_t      interleaved RoPE
    y         = round_t(y @ H_d^T), H_d = d^-1/2 * Sylvester Hadamard          only when `hadamard` (index keys)
    out_cache[out_slots[n]] = quantize(y) in `out_format` (layouts in dsv4_formats_ref.py)

Grid: one program per entry. The S slots are read in chunks of BLOCK_S rows (online softmax per channel: running
max, running sum, running weighted sum) with the whole head_dim in registers, so every needed source half-row is
read once from HBM and the output row is written once; nothing is materialised in between.

Exactness: every cast and quantization step follows `dsv4_compress_ref` (what the engine's torch backend runs)
bit for bit, with the fp32 -> bf16 / e4m3 / e2m1 roundings done on integer bits so the interpreter and the GPU
agree. The float
pipeline before them (exp, summation order of the pool and of mean(y^2), sqrt, cos/sin, FMA contraction) matches
the torch reference to a few fp32 ulps only, so a value that lands within that distance of a rounding boundary of
the compute dtype / e4m3 / e2m1 may come out one step apart (see test/kernels/test_dsv4_compress.py).

Ordering: the pool reads ring rows that `dsv4_update_ring` (ring[ring_dst] = fresh[ring_src]) overwrites, so launch
the ring update after this kernel on the same stream; or, where no written ring row is read (a decode step),
`dsv4_compress_staged` does both (and the prefix cache's boundary rows) in the same launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_attention_ref import (
    check_compress_args, dsv4_compress_ref, dsv4_compress_staged_ref, dsv4_update_ring_ref, pool_ref)
from sgl_kernel.dsv4_formats_ref import FP4_MAX, FP8_INDEX_BLOCK, FP8_KV_AMAX_FLOOR, FP8_MAX, ROW_FORMATS

_FORMAT_ID = {name: i for i, name in enumerate(ROW_FORMATS)}  # dense 0, fp8_kv 1, fp8_index 2, fp4_index 3
_DTYPE_ID = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_TILE_ELEMS = 8192  # content elements of one [BLOCK_S, BLOCK_D] chunk


def _frexp_bits(qmax: float) -> tuple:
    """qmax = m * 2^e (frexp) -> (e, threshold on fp32 mantissa bits f with (1 + f/2^23) / 2 > m)."""
    m, e = math.frexp(qmax)
    return e, int((2 * m - 1) * (1 << 23))


_FP8_QMAX_EXP, _FP8_QMAX_MANT = (tl.constexpr(v) for v in _frexp_bits(FP8_MAX))  # 448 = 0.875 * 2^9
_FP4_QMAX_EXP, _FP4_QMAX_MANT = (tl.constexpr(v) for v in _frexp_bits(FP4_MAX))  # 6 = 0.75 * 2^3
_FP8_KV_FLOOR = tl.constexpr(FP8_KV_AMAX_FLOOR)
_FP32_TINY = tl.constexpr(torch.finfo(torch.float32).tiny)  # fp4 amax floor: all-zero blocks, smallest scale


# ----------------------------------------------------------------------------- bit-exact scalar helpers


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern (round to nearest even) as int32 in [0, 65536)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def _round_to(x, KIND: tl.constexpr):
    """fp32 -> compute dtype -> fp32 (KIND 0 fp32, 1 bf16, 2 fp16)."""
    if KIND == 1:
        x = (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    elif KIND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _rint_nonneg(t):
    """Round t >= 0 (small) to the nearest integer, ties to even, as int32."""
    f = t.to(tl.int32)
    rem = t - f.to(tl.float32)
    up = (rem > 0.5) | ((rem == 0.5) & ((f & 1) == 1))
    return f + up.to(tl.int32)


@triton.jit
def _e4m3_code(x):
    """Saturating RNE fp32 -> float8_e4m3fn byte (int32 0..255); the sign of -0.0 is kept like torch's cast."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    # normals (a >= 2^-6): round the fp32 mantissa to 3 bits, rebias the exponent 127 -> 7
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormals: multiples of 2^-9 (a rounding up to 8 * 2^-9 = 2^-6 gives code 8, the smallest normal)
    sub = _rint_nonneg(a * 512.0)
    return tl.where(a >= 0.015625, normal, sub) | sign


@triton.jit
def _e2m1_code(v):
    """Nearest e2m1 code (int32 0..15, bit 3 = sign) of v, |v| saturated at 6, ties to the even code."""
    mag = tl.minimum(tl.abs(v), 6.0)
    small = mag < 2.0
    mid = mag < 4.0
    k = _rint_nonneg(mag * tl.where(small, 2.0, tl.where(mid, 1.0, 0.5)))  # grid step 0.5 / 1 / 2
    code = k + tl.where(small, 0, tl.where(mid, 2, 4))
    return code | ((v < 0).to(tl.int32) << 3)


@triton.jit
def _ue8m0_exp(amax, QMAX_EXP: tl.constexpr, QMAX_MANT: tl.constexpr):
    """Smallest e with amax <= qmax * 2^e (qmax = frexp mantissa/exponent given as bits), clamped to [-126, 126]."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 126 - QMAX_EXP + ((bits & 0x7FFFFF) > QMAX_MANT).to(tl.int32)
    return tl.minimum(tl.maximum(e, -126), 126)


@triton.jit
def _pow2(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------- pipeline stages


@triton.jit
def _pool(ring_ptr, fresh_ptr, rows_ptr, n, num_ring_rows, ring_row_stride, ring_gate_stride, fresh_row_stride,
          fresh_gate_stride, S: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr,
          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Channel-wise softmax pool of the S slots of entry n -> [BLOCK_D] fp32 (0 past D)."""
    ch = tl.arange(0, BLOCK_D)
    dmask = ch < D
    run_max = tl.full([BLOCK_D], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        slot = s0 + tl.arange(0, BLOCK_S)
        row = tl.load(rows_ptr + n * S + slot, mask=slot < S, other=-1)
        in_ring = row < num_ring_rows
        content = tl.where(in_ring, ring_ptr + row * ring_row_stride,
                           fresh_ptr + (row - num_ring_rows) * fresh_row_stride)
        gate = content + tl.where(in_ring, ring_gate_stride, fresh_gate_stride)
        if OVERLAP:  # A half (first D channels) for the previous window's slots, B half for this window's
            half = tl.where(slot >= RATIO, D, 0)
            content += half
            gate += half
        mask = (row >= 0)[:, None] & dmask[None, :]
        z = tl.load(gate[:, None] + ch[None, :], mask=mask, other=float("-inf"))
        x = tl.load(content[:, None] + ch[None, :], mask=mask, other=0.0)
        new_max = tl.maximum(run_max, tl.max(z, axis=0))
        ref = tl.where(new_max == float("-inf"), 0.0, new_max)  # a chunk of empty slots must not give NaN
        p = tl.exp(z - ref[None, :])
        alpha = tl.exp(run_max - ref)
        run_sum = run_sum * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * x, axis=0)
        run_max = new_max
    return tl.where(dmask, tl.math.div_rn(acc, tl.where(dmask, run_sum, 1.0)), 0.0)


@triton.jit
def _rms_norm(y, w_ptr, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr):
    ch = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + ch, mask=ch < D, other=0.0)
    ms = tl.math.div_rn(tl.sum(y * y, axis=0), D * 1.0)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    return _round_to(w * (y * r), KIND)


@triton.jit
def _rope(y, pos, inv_freq_ptr, D: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr):
    """Rotate interleaved pairs of the trailing ROPE dims by pos * inv_freq (pair j -> frequency j - (D-ROPE)/2)."""
    even, odd = tl.split(tl.reshape(y, (BLOCK_D // 2, 2)))
    j = tl.arange(0, BLOCK_D // 2)
    i = j - (D - ROPE) // 2
    is_rope = (i >= 0) & (j < D // 2)
    angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + i, mask=is_rope, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    new_even = _round_to(even * cos - odd * sin, KIND)
    new_odd = _round_to(even * sin + odd * cos, KIND)
    even = tl.where(is_rope, new_even, even)
    odd = tl.where(is_rope, new_odd, odd)
    return tl.reshape(tl.join(even, odd), (BLOCK_D,))


@triton.jit
def _hadamard(y, D: tl.constexpr, LOG_D: tl.constexpr):
    """Unnormalised Sylvester butterflies (a, b) -> (a + b, a - b) at strides 1, 2, 4, ... (the engine's order)."""
    for s in tl.static_range(LOG_D):
        pairs = tl.permute(tl.reshape(y, (D // (2 << s), 2, 1 << s)), (0, 2, 1))
        a, b = tl.split(pairs)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (D,))
    return y


# ----------------------------------------------------------------------------- row writers


@triton.jit
def _store_dense(row_ptr, y, D: tl.constexpr, BLOCK_D: tl.constexpr, DENSE: tl.constexpr):
    ch = tl.arange(0, BLOCK_D)
    if DENSE == 0:
        tl.store(row_ptr + ch, y, mask=ch < D)
    elif DENSE == 1:  # bf16 bits through an int16 view of the cache
        bits = _bf16_bits(y)
        tl.store(row_ptr + ch, tl.where(bits >= 32768, bits - 65536, bits).to(tl.int16), mask=ch < D)
    else:
        tl.store(row_ptr + ch, y.to(tl.float16), mask=ch < D)


@triton.jit
def _store_fp8_kv(row_ptr, y, D: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr, WIDTH: tl.constexpr):
    """[e4m3 nope | bf16 rope | ue8m0 per 64 nope | zero pad]."""
    NOPE: tl.constexpr = D - ROPE
    ch = tl.arange(0, BLOCK_D)
    blocks = tl.reshape(tl.where(ch < NOPE, y, 0.0), (BLOCK_D // 64, 64))
    e = _ue8m0_exp(tl.maximum(tl.max(tl.abs(blocks), axis=1), _FP8_KV_FLOOR), _FP8_QMAX_EXP, _FP8_QMAX_MANT)
    codes = tl.reshape(_e4m3_code(blocks * _pow2(-e)[:, None]), (BLOCK_D,))
    tl.store(row_ptr + ch, codes.to(tl.uint8), mask=ch < NOPE)
    bits = _bf16_bits(y)
    is_rope = (ch >= NOPE) & (ch < D)
    rope_off = NOPE + 2 * (ch - NOPE)
    tl.store(row_ptr + rope_off, (bits & 0xFF).to(tl.uint8), mask=is_rope)
    tl.store(row_ptr + rope_off + 1, (bits >> 8).to(tl.uint8), mask=is_rope)
    b = tl.arange(0, BLOCK_D // 64)
    tl.store(row_ptr + NOPE + 2 * ROPE + b, (e + 127).to(tl.uint8), mask=b < NOPE // 64)
    pad = NOPE + 2 * ROPE + NOPE // 64 + tl.arange(0, 8)
    tl.store(row_ptr + pad, tl.zeros([8], tl.uint8), mask=pad < WIDTH)


@triton.jit
def _store_fp8_index(row_ptr, y, D: tl.constexpr, BLOCK_D: tl.constexpr, IDX_BLOCK: tl.constexpr):
    """[e4m3 D | fp32 scale per 128]; scale = amax / 448 (correctly rounded), 1 for an all-zero block."""
    ch = tl.arange(0, BLOCK_D)
    blocks = tl.reshape(tl.where(ch < D, y, 0.0), (BLOCK_D // IDX_BLOCK, IDX_BLOCK))
    amax = tl.max(tl.abs(blocks), axis=1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scale = tl.where(scale > 0, scale, 1.0)
    codes = _e4m3_code(tl.math.div_rn(blocks, scale[:, None]))
    tl.store(row_ptr + ch, tl.reshape(codes, (BLOCK_D,)).to(tl.uint8), mask=ch < D)
    b = tl.arange(0, BLOCK_D // IDX_BLOCK)
    k = tl.arange(0, 4)
    sbytes = (scale.to(tl.int32, bitcast=True)[:, None] >> (8 * k)[None, :]) & 0xFF  # little-endian fp32
    nb = (D + 127) // 128
    tl.store(row_ptr + D + 4 * b[:, None] + k[None, :], sbytes.to(tl.uint8), mask=(b < nb)[:, None])


@triton.jit
def _store_fp4_index(row_ptr, y, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """[e2m1 pairs, low nibble = even index | ue8m0 per 32]."""
    ch = tl.arange(0, BLOCK_D)
    blocks = tl.reshape(tl.where(ch < D, y, 0.0), (BLOCK_D // 32, 32))
    e = _ue8m0_exp(tl.maximum(tl.max(tl.abs(blocks), axis=1), _FP32_TINY), _FP4_QMAX_EXP, _FP4_QMAX_MANT)
    codes = tl.reshape(_e2m1_code(blocks * _pow2(-e)[:, None]), (BLOCK_D,))
    lo, hi = tl.split(tl.reshape(codes, (BLOCK_D // 2, 2)))
    j = tl.arange(0, BLOCK_D // 2)
    tl.store(row_ptr + j, (lo | (hi << 4)).to(tl.uint8), mask=j < D // 2)
    b = tl.arange(0, BLOCK_D // 32)
    tl.store(row_ptr + D // 2 + b, (e + 127).to(tl.uint8), mask=b < D // 32)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _copy_row(dst_ptr, dst_idx_ptr, src_ptr, src_idx_ptr, i, dst_row_stride, src_row_stride,
              WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """dst[dst_idx[i]] = src[src_idx[i]] (rows of WIDTH contiguous elements)."""
    dst = tl.load(dst_idx_ptr + i).to(tl.int64)
    src = tl.load(src_idx_ptr + i).to(tl.int64)
    for c0 in range(0, WIDTH, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        v = tl.load(src_ptr + src * src_row_stride + offs, mask=offs < WIDTH)
        tl.store(dst_ptr + dst * dst_row_stride + offs, v, mask=offs < WIDTH)


# Counts only (program bounds): a prefill chunk's completed entries and staging writes depend on where it starts, so
# specialising them (== 1, divisible by 16) would compile new variants inside requests the server's warm-up never saw.
@triton.jit(do_not_specialize=["num_entries", "num_ring_writes", "num_bnd_writes"])
def _dsv4_compress_kernel(ring_ptr, fresh_ptr, rows_ptr, pos_ptr, inv_freq_ptr, w_ptr, slots_ptr, out_ptr,
                          num_ring_rows, ring_row_stride, ring_gate_stride, fresh_row_stride, fresh_gate_stride,
                          out_row_stride, eps, hadamard_scale, num_entries,
                          ring_dst_ptr, ring_src_ptr, num_ring_writes, bnd_ptr, bnd_dst_ptr, bnd_src_ptr,
                          num_bnd_writes, bnd_row_stride,
                          S: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr,
                          ROPE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr,
                          FORMAT: tl.constexpr, DENSE: tl.constexpr, HADAMARD: tl.constexpr, LOG_D: tl.constexpr,
                          WIDTH: tl.constexpr, IDX_BLOCK: tl.constexpr, STAGE: tl.constexpr,
                          STAGE_WIDTH: tl.constexpr, STAGE_BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    if n < num_entries:
        _compress_entry(ring_ptr, fresh_ptr, rows_ptr, pos_ptr, inv_freq_ptr, w_ptr, slots_ptr, out_ptr, n,
                        num_ring_rows, ring_row_stride, ring_gate_stride, fresh_row_stride, fresh_gate_stride,
                        out_row_stride, eps, hadamard_scale, S, RATIO, OVERLAP, D, ROPE, BLOCK_S, BLOCK_D, COMPUTE,
                        FORMAT, DENSE, HADAMARD, LOG_D, WIDTH, IDX_BLOCK)
    if STAGE:  # staging writes of this launch: rows no program of it reads (dsv4_compress_staged)
        if n < num_ring_writes:
            _copy_row(ring_ptr, ring_dst_ptr, fresh_ptr, ring_src_ptr, n, ring_row_stride, fresh_row_stride,
                      STAGE_WIDTH, STAGE_BLOCK)
        if n < num_bnd_writes:
            _copy_row(bnd_ptr, bnd_dst_ptr, fresh_ptr, bnd_src_ptr, n, bnd_row_stride, fresh_row_stride,
                      STAGE_WIDTH, STAGE_BLOCK)


@triton.jit
def _compress_entry(ring_ptr, fresh_ptr, rows_ptr, pos_ptr, inv_freq_ptr, w_ptr, slots_ptr, out_ptr, n,
                    num_ring_rows, ring_row_stride, ring_gate_stride, fresh_row_stride, fresh_gate_stride,
                    out_row_stride, eps, hadamard_scale,
                    S: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr,
                    ROPE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr,
                    FORMAT: tl.constexpr, DENSE: tl.constexpr, HADAMARD: tl.constexpr, LOG_D: tl.constexpr,
                    WIDTH: tl.constexpr, IDX_BLOCK: tl.constexpr):
    y = _pool(ring_ptr, fresh_ptr, rows_ptr, n, num_ring_rows, ring_row_stride, ring_gate_stride, fresh_row_stride,
              fresh_gate_stride, S, RATIO, OVERLAP, D, BLOCK_S, BLOCK_D)
    y = _rms_norm(_round_to(y, COMPUTE), w_ptr, eps, D, BLOCK_D, COMPUTE)
    if ROPE > 0:
        y = _rope(y, tl.load(pos_ptr + n), inv_freq_ptr, D, ROPE, BLOCK_D, COMPUTE)
    if HADAMARD:
        y = _round_to(_hadamard(y, BLOCK_D, LOG_D) * hadamard_scale, COMPUTE)
    row_ptr = out_ptr + tl.load(slots_ptr + n).to(tl.int64) * out_row_stride
    if FORMAT == 0:
        _store_dense(row_ptr, y, D, BLOCK_D, DENSE)
    elif FORMAT == 1:
        _store_fp8_kv(row_ptr, y, D, ROPE, BLOCK_D, WIDTH)
    elif FORMAT == 2:
        _store_fp8_index(row_ptr, y, D, BLOCK_D, IDX_BLOCK)
    else:
        _store_fp4_index(row_ptr, y, D, BLOCK_D)


@triton.jit
def _update_ring_kernel(ring_ptr, fresh_ptr, dst_ptr, src_ptr, ring_row_stride, fresh_row_stride,
                        WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    _copy_row(ring_ptr, dst_ptr, fresh_ptr, src_ptr, tl.program_id(0), ring_row_stride, fresh_row_stride, WIDTH,
              BLOCK)


# ----------------------------------------------------------------------------- wrappers


def dsv4_compress(ring: torch.Tensor, fresh: torch.Tensor, source_rows: torch.Tensor, *, ratio: int, overlap: bool,
                  head_dim: int, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor, rope_dim: int, out_cache: torch.Tensor, out_slots: torch.Tensor,
                  out_format: str, hadamard: bool = False, compute_dtype: torch.dtype = torch.float32) -> None:
    """Pool, post-process and store N = source_rows.shape[0] new entries (formula in the module docstring).

    ring [Rr, 2, C] / fresh [T, 2, C] fp32 (content, gate logit), C = 2*head_dim if overlap else head_dim;
    source_rows [N, S] int64 rows of [ring; fresh] (>= Rr: fresh row - Rr; -1 empty; each entry needs one
    non-empty slot), S = 2*ratio if overlap else ratio; norm_weight [head_dim]; positions [N] (w*m);
    inv_freq [rope_dim/2] fp32 (YaRN folded in); out_cache [rows, width] in `out_format`; out_slots [N].
    compute_dtype: the model dtype the engine rounds to after pooling, RMSNorm, RoPE and Hadamard.
    """
    check_compress_args(ring, fresh, source_rows, ratio, overlap, head_dim, norm_weight, positions, inv_freq, rope_dim,
                        out_cache, out_slots, out_format, hadamard, compute_dtype)
    if source_rows.shape[0]:
        _launch(ring, fresh, source_rows, None, ratio, overlap, head_dim, norm_weight, eps, positions, inv_freq,
                rope_dim, out_cache, out_slots, out_format, hadamard, compute_dtype)


def dsv4_compress_staged(ring: torch.Tensor, fresh: torch.Tensor, source_rows: torch.Tensor, *, ring_dst: torch.Tensor,
                         ring_src: torch.Tensor, boundary: Optional[torch.Tensor] = None,
                         boundary_dst: Optional[torch.Tensor] = None, boundary_src: Optional[torch.Tensor] = None,
                         **compress_args) -> None:
    """dsv4_compress, then ring[ring_dst] = fresh[ring_src] and boundary[boundary_dst] = fresh[boundary_src], in one
    launch (program i pools entry i and writes staging row i). The caller guarantees that no ring row written is
    one that a source row reads (a decode step: each request writes its newest positions, which lie a whole ring
    after the oldest ones its entries read); then the order of the programs does not matter."""
    args = {"hadamard": False, "compute_dtype": torch.float32, **compress_args}
    check_compress_args(ring, fresh, source_rows, **{k: v for k, v in args.items() if k != "eps"})
    check_update_ring_args(ring, ring_dst, fresh, ring_src)
    if boundary is not None:
        check_update_ring_args(boundary, boundary_dst, fresh, boundary_src)
    stage = _Stage(ring_dst, ring_src, boundary, boundary_dst, boundary_src)
    if source_rows.shape[0] or stage.num_programs():
        _launch(ring, fresh, source_rows, stage, **args)


@dataclass
class _Stage:
    """The staging writes of a dsv4_compress_staged launch."""
    ring_dst: torch.Tensor
    ring_src: torch.Tensor
    boundary: Optional[torch.Tensor]
    boundary_dst: Optional[torch.Tensor]
    boundary_src: Optional[torch.Tensor]

    def num_boundary(self) -> int:
        return 0 if self.boundary is None else self.boundary_dst.numel()

    def num_programs(self) -> int:
        return max(self.ring_dst.numel(), self.num_boundary())


def _launch(ring, fresh, source_rows, stage: Optional[_Stage], ratio, overlap, head_dim, norm_weight, eps, positions,
            inv_freq, rope_dim, out_cache, out_slots, out_format, hadamard=False,
            compute_dtype=torch.float32) -> None:
    n = source_rows.shape[0]
    s = source_rows.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    block_s = min(triton.next_power_of_2(s), max(1, _TILE_ELEMS // block_d))
    tile = block_s * block_d
    dense = _DTYPE_ID.get(out_cache.dtype, 0)
    out = out_cache.view(torch.int16) if out_cache.dtype == torch.bfloat16 else out_cache
    stage_width = ring.shape[1] * ring.shape[2]
    if stage is None:
        grid, stage_args = n, (source_rows, source_rows, 0, ring, source_rows, source_rows, 0, 0)
    else:
        boundary = stage.boundary if stage.boundary is not None else ring
        bnd_dst = stage.boundary_dst if stage.boundary is not None else stage.ring_dst
        bnd_src = stage.boundary_src if stage.boundary is not None else stage.ring_src
        grid = max(n, stage.num_programs())
        stage_args = (stage.ring_dst, stage.ring_src, stage.ring_dst.numel(), boundary, bnd_dst, bnd_src,
                      stage.num_boundary(), boundary.stride(0))
    _dsv4_compress_kernel[(grid,)](
        ring, fresh, source_rows, positions, inv_freq, norm_weight.to(torch.float32), out_slots, out,
        ring.shape[0], ring.stride(0), ring.stride(1), fresh.stride(0), fresh.stride(1), out.stride(0),
        float(eps), float(head_dim) ** -0.5, n, *stage_args,
        S=s, RATIO=ratio, OVERLAP=overlap, D=head_dim, ROPE=rope_dim, BLOCK_S=block_s, BLOCK_D=block_d,
        COMPUTE=_DTYPE_ID[compute_dtype], FORMAT=_FORMAT_ID[out_format], DENSE=dense, HADAMARD=hadamard,
        LOG_D=int(math.log2(block_d)), WIDTH=out_cache.shape[1], IDX_BLOCK=min(FP8_INDEX_BLOCK, block_d),
        STAGE=stage is not None, STAGE_WIDTH=stage_width, STAGE_BLOCK=min(triton.next_power_of_2(stage_width), 2048),
        num_warps=2 if tile <= 1024 else 4 if tile <= 2048 else 8)


def check_update_ring_args(ring: torch.Tensor, ring_dst: torch.Tensor, fresh: torch.Tensor,
                           ring_src: torch.Tensor) -> None:
    assert ring.dim() == 3 and fresh.dim() == 3 and ring.shape[1:] == fresh.shape[1:] and ring.dtype == fresh.dtype, \
        f"ring {ring.dtype} {tuple(ring.shape)} and fresh {fresh.dtype} {tuple(fresh.shape)} rows must match"
    assert ring_dst.shape == ring_src.shape and ring_dst.dim() == 1, \
        f"ring_dst {tuple(ring_dst.shape)} and ring_src {tuple(ring_src.shape)} must be equal 1-D"
    assert all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (ring, fresh)), \
        "ring / fresh rows [2, C] must be contiguous"


def dsv4_update_ring(ring: torch.Tensor, ring_dst: torch.Tensor, fresh: torch.Tensor, ring_src: torch.Tensor) -> None:
    """ring[ring_dst] = fresh[ring_src] (whole [2, C] rows); launch after dsv4_compress has read the ring."""
    check_update_ring_args(ring, ring_dst, fresh, ring_src)
    if ring_dst.numel() == 0:
        return
    width = ring.shape[1] * ring.shape[2]
    _update_ring_kernel[(ring_dst.numel(),)](ring, fresh, ring_dst, ring_src, ring.stride(0), fresh.stride(0),
                                             WIDTH=width, BLOCK=min(triton.next_power_of_2(width), 2048),
                                             num_warps=4)


__all__ = ["dsv4_compress", "dsv4_compress_ref", "dsv4_compress_staged", "dsv4_compress_staged_ref", "dsv4_update_ring",
           "dsv4_update_ring_ref", "pool_ref"]
