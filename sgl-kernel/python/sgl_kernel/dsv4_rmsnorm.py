"""dsv4_rms_norm: RMSNorm over the last dim in one launch, fp32 math, result in x's dtype.

    y = x / sqrt(mean(x^2) + eps) [* weight]

The same arithmetic as the engine's torch path (sglang.srt.layers.norm, its reference): the row is read once in
fp32, the weight is applied in fp32, and the result is cast back once. The torch path costs about eight launches
per call (casts, square, mean, rsqrt, products); DeepSeek-V4 runs several norms per layer per step.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _dsv4_rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, HAS_WEIGHT: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * inv
    if HAS_WEIGHT:
        y = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * y
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def dsv4_rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """x [..., D] (last dim contiguous) -> RMSNorm(x) [..., D] in x.dtype; weight [D] or None."""
    d = x.shape[-1]
    assert x.stride(-1) == 1, "x: the last dim must be contiguous"
    assert weight is None or (weight.shape == (d,) and weight.is_contiguous()), f"weight must be [{d}] contiguous"
    rows = x.reshape(-1, d)  # a view for the usual layouts (token-major, heads inside)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _dsv4_rms_norm_kernel[(rows.shape[0],)](
            rows, weight if weight is not None else rows, out, d, rows.stride(0), out.stride(0), eps,
            HAS_WEIGHT=weight is not None, BLOCK_D=block, num_warps=max(1, min(16, block // 256)))
    return out.view(x.shape)
