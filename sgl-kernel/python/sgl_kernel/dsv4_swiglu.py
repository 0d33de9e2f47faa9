"""dsv4_clamped_swiglu: DeepSeek-V4's clamped SwiGLU of the shared expert, silu(min(g, L)) * clamp(u, -L, L), in one
launch; dsv4_clamped_swiglu_fp8 also quantizes the result for the FP8 W8A8 linear that reads it (w2).

The torch path (sglang.srt.layers.moe.experts.clamped_swiglu, the reference) costs four launches (two clamps, silu,
the product), and w2's activation quantization a fifth that reads the whole row again. The kernel rounds where torch
does: the limit to the activations' dtype (torch's clamp takes its bound in the tensor's dtype), silu's fp32 result
to that dtype, then the product of the two 16-bit values (exact in fp32) to that dtype; the quantization is
dsv4_fp8_gemm.quantize_rows of that result, so the codes and multipliers are dsv4_fp8_act_quant's of the SwiGLU
output. On NVIDIA GPUs silu takes libdevice's expf and an IEEE division, the arithmetic of torch's CUDA silu; the
CPU interpreter has no libdevice and takes Triton's exp (its silu can differ from torch's CPU one in the last bit).

gate and up are [M, I] with contiguous rows, any row strides: the halves of a joined w13's output
(`y.chunk(2, -1)`) or two separate outputs.
"""

from __future__ import annotations

import functools
import math
import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from sgl_kernel.dsv4_fp8_gemm import fp8_act_buffers, quantize_rows
from sgl_kernel.dsv4_fp8_gemm_ref import BLOCK, fp8_max
from sgl_kernel.dsv4_moe_sums import bf16_bits
from sgl_kernel.dsv4_rmsnorm import round_to
from sgl_kernel.dsv4_pdl import interpreting


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, M, I, stride_g, stride_u, stride_h, stride_q, stride_s,
                   stride_sc, limit, BLOCK_M: tl.constexpr, QUANT: tl.constexpr, LIBDEVICE: tl.constexpr,
                   FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr, BF16_BITS: tl.constexpr):
    """BLOCK_M rows x one 128-channel block: the clamped SwiGLU rounded as torch rounds it (h_ptr's dtype is the
    activations'); QUANT: its e4m3 codes (q_ptr) and per-row multiplier of the block (s_ptr, strides stride_s per
    row, stride_sc per block), else the result itself (h_ptr)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < M) & (cols[None, :] < I)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    ty = h_ptr.dtype.element_ty
    silu = round_to(tl.math.div_rn(g, 1.0 + e), ty, BF16_BITS).to(tl.float32)
    h = round_to(silu * u, ty, BF16_BITS)
    if QUANT:
        q, scale = quantize_rows(h.to(tl.float32), FP8_MAX, ROUND_IN_FP32)
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows * stride_s + tl.program_id(1) * stride_sc, scale, mask=rows < M)
    else:
        tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask)


def _rows(gate: torch.Tensor, up: torch.Tensor) -> None:
    if (gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype or gate.stride(1) != 1
            or up.stride(1) != 1 or gate.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} stride {gate.stride()} / up {tuple(up.shape)} "
                         f"{up.dtype} stride {up.stride()}: two [M, I] bf16 / fp16 / fp32 tensors with contiguous rows")


@functools.lru_cache(maxsize=None)
def limit_in(dtype: torch.dtype, limit: float) -> float:
    """The bound torch's clamp applies to a tensor of `dtype`: the limit rounded to that dtype (to nearest even), on
    the host's floats (no tensor: nothing for a graph capture or a census to see)."""
    if math.isinf(limit) or math.isnan(limit):
        return limit
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", limit))[0]
    single = struct.unpack("<f", struct.pack("<f", limit))[0]
    if dtype != torch.bfloat16:
        return single
    bits = struct.unpack("<I", struct.pack("<f", single))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def swiglu_row_block(rows: int) -> int:
    """Rows a program takes (a constexpr: one compiled variant per value): up to 16, a power of two, so decode's few
    rows spend no lanes on masked rows. The server's warm-up plans its prompts from this."""
    return min(16, triton.next_power_of_2(rows))


def _launch(gate, up, h, q, s, limit: float, quant: bool) -> None:
    m, inter = gate.shape
    if not m or not inter:
        return
    block_m = swiglu_row_block(m)
    _swiglu_kernel[(triton.cdiv(m, block_m), triton.cdiv(inter, BLOCK))](
        gate, up, h, q, s, m, inter, gate.stride(0), up.stride(0), h.stride(0), q.stride(0), s.stride(0),
        s.stride(-1), limit_in(gate.dtype, limit), BLOCK_M=block_m, QUANT=quant, LIBDEVICE=not interpreting(),
        FP8_MAX=fp8_max(q.dtype) if quant else 448.0, ROUND_IN_FP32=gate.device.type != "cuda",
        BF16_BITS=bf16_bits(gate.dtype, gate.device), num_warps=4)


def dsv4_clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [M, I] -> silu(min(gate, L)) * clamp(up, -L, L) [M, I] in their dtype, one launch."""
    _rows(gate, up)
    h = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _launch(gate, up, h, h, h, limit, quant=False)
    return h


def dsv4_clamped_swiglu_fp8(gate: torch.Tensor, up: torch.Tensor, limit: float, cublas_layout: bool = False,
                            fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple:
    """gate, up [M, I] -> (e4m3 [M, I] in fp8_dtype, fp32 multipliers [M, ceil(I / 128)]): the clamped SwiGLU
    quantized per row and 128 channels, dsv4_fp8_act_quant(dsv4_clamped_swiglu(gate, up, limit),
    cublas_layout=cublas_layout, dtype=fp8_dtype)'s codes and multipliers (cuBLAS's layout if asked:
    sgl_kernel.dsv4_fp8_gemm.fp8_act_buffers), one launch."""
    _rows(gate, up)
    m, inter = gate.shape
    q, s = fp8_act_buffers(m, inter, triton.cdiv(inter, BLOCK), cublas_layout, gate.device, fp8_dtype)
    h = torch.empty(1, dtype=gate.dtype, device=gate.device)  # the result's dtype only: not written
    _launch(gate, up, h, q, s, limit, quant=True)
    return q, s
