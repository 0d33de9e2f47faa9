"""dsv4_qk_norm_rope: RMSNorm of each head's row, then DeepSeek-V4's interleaved partial RoPE, in one launch.

    y = x / sqrt(mean(x^2) + eps) [* weight]          fp32, rounded to x's dtype
    y[D - R:] pairs (2i, 2i+1) rotated by pos_t * inv_freq[i]

The attention's query heads take the unweighted norm, the shared K=V vector the weighted one (kv_norm). The
arithmetic is the engine's torch path, step for step (sglang.srt.layers.rotary RotaryEmbedding.apply_normed, the
reference: RMSNorm as sglang.srt.layers.norm computes it, the normed row rounded to x's dtype, then the rotation of
the rounded pairs in fp32 and one more rounding), so where the torch path is exact (fp32) so is this; the two
kernels it replaces (dsv4_rms_norm + dsv4_rope) give the same values but for the sum of squares' order. Rows are read
through their strides (the joined projections' split views), so no copy precedes the launch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_rmsnorm import norm_warps, round_to


@triton.jit
def _dsv4_qk_norm_rope_kernel(x_ptr, w_ptr, pos_ptr, inv_ptr, out_ptr, H, stride_xt, stride_xh, stride_ot, stride_oh,
                              eps, HAS_WEIGHT: tl.constexpr, NOPE: tl.constexpr, HALF_R: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BF16_BITS: tl.constexpr):
    """One head of one row: its sum of squares over the whole row (read once as dsv4_rms_norm reads it), the first
    NOPE dims written normed, the rope pairs read again (from cache), normed and rounded the same way, rotated."""
    pid = tl.program_id(0)
    t = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = out_ptr + t * stride_ot + h * stride_oh
    ty = out_ptr.dtype.element_ty
    d = NOPE + 2 * HALF_R
    cols = tl.arange(0, BLOCK_D)
    x = tl.load(src + cols, mask=cols < d, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
    y = x * inv
    if HAS_WEIGHT:
        y = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32) * y
    tl.store(dst + cols, round_to(y, ty, BF16_BITS), mask=cols < NOPE)
    i = tl.arange(0, BLOCK_R)
    mask = i < HALF_R
    even = tl.load(src + NOPE + 2 * i, mask=mask, other=0.0).to(tl.float32) * inv
    odd = tl.load(src + NOPE + 2 * i + 1, mask=mask, other=0.0).to(tl.float32) * inv
    if HAS_WEIGHT:
        even = tl.load(w_ptr + NOPE + 2 * i, mask=mask, other=0.0).to(tl.float32) * even
        odd = tl.load(w_ptr + NOPE + 2 * i + 1, mask=mask, other=0.0).to(tl.float32) * odd
    even = round_to(even, ty, BF16_BITS).to(tl.float32)  # the normed row as stored in x's dtype, as the torch path
    odd = round_to(odd, ty, BF16_BITS).to(tl.float32)  # rotates it
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + i, mask=mask, other=0.0)
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    tl.store(dst + NOPE + 2 * i, round_to(even * cos - odd * sin, ty, BF16_BITS), mask=mask)
    tl.store(dst + NOPE + 2 * i + 1, round_to(even * sin + odd * cos, ty, BF16_BITS), mask=mask)


def dsv4_qk_norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, positions: torch.Tensor,
                      inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] or [T, D] (last dim contiguous, other strides free), weight [D] or None, positions [T],
    inv_freq [R/2] fp32 -> RoPE(RMSNorm(x)) as a new contiguous tensor of x's shape and dtype."""
    half = inv_freq.numel()
    d = x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or 2 * half > d:
        raise ValueError(f"x must be [T, H, D] or [T, D] with D >= {2 * half} and a contiguous last dim, got "
                         f"{tuple(x.shape)} stride {x.stride()}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions must be [{x.shape[0]}], got {tuple(positions.shape)}")
    if weight is not None and (weight.shape != (d,) or weight.stride(0) != 1):
        raise ValueError(f"weight must be [{d}] contiguous, got {tuple(weight.shape)}")
    x3 = x if x.dim() == 3 else x[:, None]  # a view: one head
    t, heads = x3.shape[0], x3.shape[1]
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if t * heads:
        block = triton.next_power_of_2(d)
        _dsv4_qk_norm_rope_kernel[(t * heads,)](
            x3, weight if weight is not None else x3, positions, inv_freq.float().contiguous(), out, heads,
            x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), eps, HAS_WEIGHT=weight is not None,
            NOPE=d - 2 * half, HALF_R=half, BLOCK_D=block, BLOCK_R=triton.next_power_of_2(half),
            BF16_BITS=x.dtype == torch.bfloat16 and x.device.type != "cuda", num_warps=norm_warps(block))
    return out.view(x.shape)
