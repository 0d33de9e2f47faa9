"""The one definition of the DeepSeek-V4 cache-row formats and entry post-processing, in torch (no Triton, no engine
imports).

The engine's entry formats (sglang.srt.mem_cache.kv_formats) encode and decode through these functions, the
references of the sgl_kernel ops (dsv4_attention_ref.py) use them, and the Triton kernels are tested against them.
Every function computes in fp32 and rounds to the compute dtype where the engine's module boundary casts (RMSNorm
output, RoPE output, Hadamard output), so a kernel that follows the same steps reproduces the engine bit for bit
given identical inputs. Everything is vectorised with no host syncs, so it also runs inside CUDA graphs.

Post-processing of one entry x [D] (docs/dsv4-architecture.md 5.3-5.5), compute dtype t:
    y = round_t(w * (x * rsqrt(mean(x^2) + eps)))                         RMSNorm, x already round_t'd
    (y_2i, y_2i+1) <- rotate by pos * inv_freq[i] on the trailing R dims   interleaved RoPE, round_t
    y <- round_t(y @ H_D^T), H_D Sylvester Hadamard scaled by D^-1/2      index keys before quantization only

Row formats (`ROW_FORMATS`, all little-endian; arch 9.4):
    dense      D values in the cache dtype (fp32 / bf16 / fp16), RNE cast
    fp8_kv     [e4m3 nope (D-R) | bf16 rope (2R B) | ue8m0 byte per 64 nope | zero pad to 8 B];
               s = 2^ceil(log2(max(amax, 1e-4) / 448)) per 64-block, code = e4m3(x / s)
    fp8_index  [e4m3 D | fp32 scale per 128 (4 B)]; s = amax / 448 (1 when amax = 0), partial block zero-padded
    fp4_index  [e2m1 nibbles, D/2 B, low nibble = even index | ue8m0 byte per 32];
               s = 2^ceil(log2(max(amax, tiny) / 6)), code = nearest e2m1 (ties to even code) of x / s
A ue8m0 byte b decodes to 2^(b - 127); exponents stay in [-126, 126] so 2^e and 2^-e are normal fp32, and byte 0
(an unwritten row) decodes to 0.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 magnitude
UE8M0_BIAS = 127
FP8_KV_BLOCK, FP8_KV_AMAX_FLOOR = 64, 1e-4  # the floor keeps all-zero blocks at a finite scale
FP8_INDEX_BLOCK = 128
FP4_BLOCK = 32
ROW_FORMATS = ("dense", "fp8_kv", "fp8_index", "fp4_index")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # dense row dtypes and compute dtypes


def layout_error(out_format: str, dim: int, rope_dim: int = 0) -> Optional[str]:
    """Why an entry of `dim` values (`rope_dim` of them RoPE'd) has no `out_format` row, or None when it has one."""
    if out_format not in ROW_FORMATS:
        return f"out_format {out_format!r} not in {ROW_FORMATS}"
    if dim <= 0:
        return f"dim must be positive, got {dim}"
    nope = dim - rope_dim
    if out_format == "fp8_kv" and (rope_dim < 0 or nope <= 0 or nope % FP8_KV_BLOCK):
        return f"nope dim (dim - rope_dim = {dim} - {rope_dim} = {nope}) must be a positive multiple of {FP8_KV_BLOCK}"
    if out_format == "fp4_index" and dim % FP4_BLOCK:
        return f"dim {dim} must be a positive multiple of {FP4_BLOCK}"
    return None


def fp8_kv_row_bytes(dim: int, rope_dim: int) -> int:
    """Bytes of one fp8_kv row: nope e4m3 + rope bf16 + one scale per 64 nope values, padded to 8."""
    nope = dim - rope_dim
    return -(-(nope + 2 * rope_dim + nope // FP8_KV_BLOCK) // 8) * 8


def row_width(out_format: str, dim: int, rope_dim: int, dense_dtype: torch.dtype = torch.float32) -> int:
    """Elements per cache row (bytes for the quantized formats, `dense_dtype` elements for dense)."""
    if out_format == "dense":
        return dim
    if out_format == "fp8_kv":
        return fp8_kv_row_bytes(dim, rope_dim)
    if out_format == "fp8_index":
        return dim + 4 * -(-dim // FP8_INDEX_BLOCK)
    if out_format == "fp4_index":
        return dim // 2 + dim // FP4_BLOCK
    raise ValueError(f"out_format {out_format!r} not in {ROW_FORMATS}")


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype -> fp32 (round to nearest even); identity for fp32."""
    return x if dtype == torch.float32 else x.to(dtype).to(torch.float32)


# ----------------------------------------------------------------------------- post-processing


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """x [N, D] fp32 holding dtype values -> round_dtype(weight * (x * rsqrt(mean(x^2) + eps)))."""
    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return round_to(weight.to(torch.float32) * normed, dtype)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
             dtype: torch.dtype) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of the trailing rope_dim dims of x [N, D] by positions[n] * inv_freq[i]."""
    if rope_dim == 0:
        return x
    angle = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [N, R/2]
    cos, sin = angle.cos(), angle.sin()
    pairs = x[:, x.shape[1] - rope_dim:].reshape(x.shape[0], rope_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).reshape(x.shape[0], rope_dim)
    return torch.cat((x[:, : x.shape[1] - rope_dim], round_to(rotated, dtype)), dim=1)


def hadamard_ref(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [N, D] -> round_dtype(x @ H_D^T * D^-1/2): butterflies (a, b) -> (a + b, a - b) at strides 1, 2, 4, ..."""
    n, d = x.shape
    assert d > 0 and d & (d - 1) == 0, f"hadamard needs a power-of-two dim, got {d}"
    y = x
    stride = 1
    while stride < d:
        pairs = y.reshape(n, d // (2 * stride), 2, stride)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).reshape(n, d)
        stride *= 2
    return round_to(y * (d ** -0.5), dtype)


# ----------------------------------------------------------------------------- codes and scales


def ue8m0_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest int e with amax <= qmax * 2^e, in [-126, 126], exact: on frexp mantissas, with no log2 or division
    (CUDA divides by a scalar through its reciprocal and log2f is not exact), so CPU and GPU agree bit for bit."""
    qm, qe = math.frexp(qmax)
    m, e = torch.frexp(amax)
    return (e - qe + (m > qm).to(e.dtype)).clamp(-126, 126).to(torch.int32)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for int e in [-126, 127], built from the exponent bits."""
    return ((e.to(torch.int32) + UE8M0_BIAS) << 23).view(torch.float32)


def ue8m0_scale(b: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> 2^(b - 127) as fp32 (byte 0 -> 0)."""
    return (b.to(torch.int32) << 23).view(torch.float32)


def e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """Saturating RNE cast to float8_e4m3fn, as raw bytes (torch's cast gives NaN out of range: clamp first)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (0..15, bit 3 = sign) of v, magnitudes saturated at 6, ties to the even code."""
    mag = v.abs().clamp(max=FP4_MAX)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))  # grid spacing on [0, 2), [2, 4), [4, 6]
    q = torch.round(mag / step) * step  # round() is half-to-even == the even code on ties
    code = torch.where(q < 2, 2 * q, torch.where(q < 4, q + 2, q / 2 + 4))
    return code.to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)


def e2m1_values(code: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0..15) -> exact fp32 values (0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 negates, so code 8 is -0)."""
    m = (code & 7).to(torch.int32)
    e, mant = m >> 1, (m & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * mant, (1 << (e - 1).clamp_min(0)).to(torch.float32) * (1 + 0.5 * mant))
    return torch.where((code & 8) != 0, -mag, mag)


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret the last dim of x as uint8 (itemsize x wider)."""
    return x.contiguous().view(torch.uint8)


def _from_bytes(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a byte slice (last dim) as `dtype`; the copy makes it aligned."""
    return rows.contiguous().view(dtype)


# ----------------------------------------------------------------------------- rows: values [..., D] <-> rows


def quantize_fp8_kv(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    x = x.to(torch.float32)
    lead, d = x.shape[:-1], x.shape[-1]
    nope = d - rope_dim
    nb = nope // FP8_KV_BLOCK
    blocks = x[..., :nope].reshape(*lead, nb, FP8_KV_BLOCK)
    e = ue8m0_exponent(blocks.abs().amax(-1, keepdim=True).clamp_min(FP8_KV_AMAX_FLOOR), FP8_MAX)
    codes = e4m3_bytes(blocks * pow2(-e)).reshape(*lead, nope)
    rope = _bytes_of(x[..., nope:].to(torch.bfloat16))
    scales = (e + UE8M0_BIAS).to(torch.uint8).reshape(*lead, nb)
    pad = torch.zeros(*lead, fp8_kv_row_bytes(d, rope_dim) - nope - 2 * rope_dim - nb, dtype=torch.uint8,
                      device=x.device)
    return torch.cat((codes, rope, scales, pad), dim=-1)


def dequantize_fp8_kv(rows: torch.Tensor, dim: int, rope_dim: int) -> torch.Tensor:
    lead = rows.shape[:-1]
    nope = dim - rope_dim
    nb, scale_off = nope // FP8_KV_BLOCK, nope + 2 * rope_dim
    q = _from_bytes(rows[..., :nope], torch.float8_e4m3fn).to(torch.float32)
    s = ue8m0_scale(rows[..., scale_off: scale_off + nb])
    vals = (q.view(*lead, nb, FP8_KV_BLOCK) * s.unsqueeze(-1)).view(*lead, nope)
    rope = _from_bytes(rows[..., nope: scale_off], torch.bfloat16)
    return torch.cat((vals, rope.to(torch.float32)), dim=-1)


def _index_blocks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., dim] -> [..., nb, 128], the partial last block zero-padded."""
    nb = -(-dim // FP8_INDEX_BLOCK)
    pad = nb * FP8_INDEX_BLOCK - dim
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], nb, FP8_INDEX_BLOCK)


def quantize_fp8_index(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float32)
    lead, d = x.shape[:-1], x.shape[-1]
    blocks = _index_blocks(x, d)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = amax / torch.full_like(amax, FP8_MAX)  # tensor / tensor: correctly rounded on CPU and CUDA alike
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = e4m3_bytes(blocks / scale).reshape(*lead, blocks.shape[-2] * FP8_INDEX_BLOCK)[..., :d]
    return torch.cat((codes, _bytes_of(scale.squeeze(-1))), dim=-1)


def dequantize_fp8_index(rows: torch.Tensor, dim: int) -> torch.Tensor:
    nb = -(-dim // FP8_INDEX_BLOCK)
    q = _from_bytes(rows[..., :dim], torch.float8_e4m3fn).to(torch.float32)
    scale = _from_bytes(rows[..., dim: dim + 4 * nb], torch.float32)
    blocks = _index_blocks(q, dim) * scale.unsqueeze(-1)
    return blocks.reshape(*rows.shape[:-1], nb * FP8_INDEX_BLOCK)[..., :dim]


def quantize_fp4_index(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float32)
    lead, d = x.shape[:-1], x.shape[-1]
    nb = d // FP4_BLOCK
    blocks = x.reshape(*lead, nb, FP4_BLOCK)
    # tiny floor: an all-zero block gets the smallest scale and all-zero codes
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    e = ue8m0_exponent(amax, FP4_MAX)
    codes = e2m1_codes(blocks * pow2(-e)).reshape(*lead, d // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return torch.cat((packed, (e + UE8M0_BIAS).to(torch.uint8).reshape(*lead, nb)), dim=-1)


def dequantize_fp4_index(rows: torch.Tensor, dim: int) -> torch.Tensor:
    lead = rows.shape[:-1]
    nb = dim // FP4_BLOCK
    packed = rows[..., : dim // 2]
    codes = torch.stack((packed & 15, packed >> 4), dim=-1)  # low nibble = even index
    vals = e2m1_values(codes).view(*lead, nb, FP4_BLOCK)
    s = ue8m0_scale(rows[..., dim // 2: dim // 2 + nb])
    return (vals * s.unsqueeze(-1)).view(*lead, dim)


def quantize_ref(x: torch.Tensor, out_format: str, rope_dim: int, dense_dtype: torch.dtype) -> torch.Tensor:
    """Values [..., D] -> rows [..., row_width] in the format's storage dtype (uint8, or dense_dtype for dense)."""
    if out_format == "dense":
        return x.to(dense_dtype)
    if out_format == "fp8_kv":
        return quantize_fp8_kv(x, rope_dim)
    if out_format == "fp8_index":
        return quantize_fp8_index(x)
    if out_format == "fp4_index":
        return quantize_fp4_index(x)
    raise ValueError(f"out_format {out_format!r} not in {ROW_FORMATS}")


def dequantize_ref(rows: torch.Tensor, out_format: str, dim: int, rope_dim: int = 0) -> torch.Tensor:
    """Rows [..., row_width] -> values [..., dim] fp32."""
    if out_format == "dense":
        return rows.to(torch.float32)
    if out_format == "fp8_kv":
        return dequantize_fp8_kv(rows, dim, rope_dim)
    if out_format == "fp8_index":
        return dequantize_fp8_index(rows, dim)
    if out_format == "fp4_index":
        return dequantize_fp4_index(rows, dim)
    raise ValueError(f"out_format {out_format!r} not in {ROW_FORMATS}")
