"""Torch references of the DeepSeek-V4 entry post-processing and cache-row formats (no engine imports).

Shared by the `*_ref` functions of the sgl_kernel ops that write cache rows. Every function computes in fp32 and
rounds to the compute dtype where the engine's module boundary casts (RMSNorm output, RoPE output, Hadamard output),
so a kernel that follows the same steps reproduces the engine bit for bit given identical inputs.

Post-processing of one entry x [D] (docs/dsv4-architecture.md 5.3-5.5), compute dtype t:
    y = round_t(w * (x * rsqrt(mean(x^2) + eps)))                         RMSNorm, x already round_t'd
    (y_2i, y_2i+1) <- rotate by pos * inv_freq[i] on the trailing R dims   interleaved RoPE, round_t
    y <- round_t(y @ H_D^T), H_D Sylvester Hadamard scaled by D^-1/2      index keys before quantization only

Row formats (byte layouts of sglang.srt.mem_cache.kv_formats; all little-endian):
    dense      D values in the cache dtype (fp32 / bf16 / fp16), RNE cast
    fp8_kv     [e4m3 nope (D-R) | bf16 rope (2R B) | ue8m0 byte per 64 nope | zero pad to 8 B];
               s = 2^ceil(log2(max(amax, 1e-4) / 448)) per 64-block, code = e4m3(x / s)
    fp8_index  [e4m3 D | fp32 scale per 128 (4 B)]; s = amax / 448 (1 when amax = 0), partial block zero-padded
    fp4_index  [e2m1 nibbles, D/2 B, low nibble = even index | ue8m0 byte per 32];
               s = 2^ceil(log2(max(amax, tiny) / 6)), code = nearest e2m1 (ties to even code) of x / s
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
UE8M0_BIAS = 127
FP8_KV_BLOCK, FP8_KV_AMAX_FLOOR = 64, 1e-4
FP8_INDEX_BLOCK = 128
FP4_BLOCK = 32
OUT_FORMATS = ("dense", "fp8_kv", "fp8_index", "fp4_index")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def row_width(out_format: str, dim: int, rope_dim: int, dense_dtype: torch.dtype = torch.float32) -> int:
    """Elements per cache row (bytes for the quantized formats, `dense_dtype` elements for dense)."""
    if out_format == "dense":
        return dim
    if out_format == "fp8_kv":
        nope = dim - rope_dim
        return -(-(nope + 2 * rope_dim + nope // FP8_KV_BLOCK) // 8) * 8
    if out_format == "fp8_index":
        return dim + 4 * -(-dim // FP8_INDEX_BLOCK)
    if out_format == "fp4_index":
        return dim // 2 + dim // FP4_BLOCK
    raise ValueError(f"out_format {out_format!r} not in {OUT_FORMATS}")


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


# ----------------------------------------------------------------------------- quantization pieces


def ue8m0_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest int e with amax <= qmax * 2^e, in [-126, 126], exact (frexp, no log2)."""
    qm, qe = math.frexp(qmax)
    m, e = torch.frexp(amax)
    return (e - qe + (m > qm).to(e.dtype)).clamp(-126, 126).to(torch.int32)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32, built from the exponent bits."""
    return ((e.to(torch.int32) + UE8M0_BIAS) << 23).view(torch.float32)


def e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """Saturating RNE cast to float8_e4m3fn, as raw bytes."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (0..15, bit 3 = sign) of v, magnitudes saturated at 6, ties to the even code."""
    mag = v.abs().clamp(max=FP4_MAX)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    q = torch.round(mag / step) * step
    code = torch.where(q < 2, 2 * q, torch.where(q < 4, q + 2, q / 2 + 4))
    return code.to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def quantize_fp8_kv(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    n, d = x.shape
    nope = d - rope_dim
    blocks = x[:, :nope].reshape(n, nope // FP8_KV_BLOCK, FP8_KV_BLOCK)
    e = ue8m0_exponent(blocks.abs().amax(-1, keepdim=True).clamp_min(FP8_KV_AMAX_FLOOR), FP8_MAX)
    codes = e4m3_bytes(blocks * pow2(-e)).reshape(n, nope)
    rope = _bytes_of(x[:, nope:].to(torch.bfloat16))
    scales = (e + UE8M0_BIAS).to(torch.uint8).reshape(n, -1)
    pad = torch.zeros(n, row_width("fp8_kv", d, rope_dim) - nope - 2 * rope_dim - scales.shape[1], dtype=torch.uint8,
                      device=x.device)
    return torch.cat((codes, rope, scales, pad), dim=1)


def quantize_fp8_index(x: torch.Tensor) -> torch.Tensor:
    n, d = x.shape
    nb = -(-d // FP8_INDEX_BLOCK)
    blocks = torch.nn.functional.pad(x, (0, nb * FP8_INDEX_BLOCK - d)).reshape(n, nb, FP8_INDEX_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = amax / torch.full_like(amax, FP8_MAX)  # tensor / tensor: correctly rounded
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = e4m3_bytes(blocks / scale).reshape(n, -1)[:, :d]
    return torch.cat((codes, _bytes_of(scale.reshape(n, nb))), dim=1)


def quantize_fp4_index(x: torch.Tensor) -> torch.Tensor:
    n, d = x.shape
    blocks = x.reshape(n, d // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    e = ue8m0_exponent(amax, FP4_MAX)
    codes = e2m1_codes(blocks * pow2(-e)).reshape(n, d // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return torch.cat((packed, (e + UE8M0_BIAS).to(torch.uint8).reshape(n, -1)), dim=1)


def quantize_ref(x: torch.Tensor, out_format: str, rope_dim: int, dense_dtype: torch.dtype) -> torch.Tensor:
    """x [N, D] fp32 -> rows [N, row_width] in the format's storage dtype."""
    if out_format == "dense":
        return x.to(dense_dtype)
    if out_format == "fp8_kv":
        return quantize_fp8_kv(x, rope_dim)
    if out_format == "fp8_index":
        return quantize_fp8_index(x)
    if out_format == "fp4_index":
        return quantize_fp4_index(x)
    raise ValueError(f"out_format {out_format!r} not in {OUT_FORMATS}")
