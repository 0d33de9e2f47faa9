"""dsv4_rope: DeepSeek-V4's interleaved partial RoPE (or its inverse) in one launch.

For x [T, ..., D] and the rotary slice r = x[..., D - R:], pairs (r[2i], r[2i+1]) rotate by angle pos_t * inv_freq[i]
(the negative angle when `inverse`, used to de-rotate the attention output); the first D - R dims are copied.
cos / sin are computed in the kernel from the positions (fp32 angle pos * inv_freq, as the torch path does), so one
launch replaces the torch path's dozen (sglang.srt.layers.rotary, the reference). The result is a new tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    i = tl.arange(0, BLOCK_R)
    mask = i < HALF_R
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + i, mask=mask, other=0.0)
    cos = tl.cos(angle)
    sin = tl.sin(angle) * sign
    even = tl.load(src + NOPE + 2 * i, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + NOPE + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(dst + NOPE + 2 * i, (even * cos - odd * sin).to(ty), mask=mask)
    tl.store(dst + NOPE + 2 * i + 1, (even * sin + odd * cos).to(ty), mask=mask)


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
