"""Interleaved partial RoPE on the trailing `rope_dim` dims of a head, with optional YaRN (arch section 5.3).

Pairs are (2i, 2i+1) of the rotary slice, rotated by pos * w_i, w_i = theta^(-2i/Dr). Compressed layers use
compress_rope_theta with YaRN frequency interpolation and no magnitude factor; sliding-only layers and MTP use
rope_theta without YaRN. The same table serves queries, window KV, compressed entries and indexer q/k.
On GPUs `apply` runs sgl_kernel's one-launch `dsv4_rope` (`apply_fp8`: its FP8-quantizing twin, for the attention
output before an FP8 wo_a; `apply_normed`: RMSNorm and RoPE as one launch, dsv4_qk_norm_rope, for the attention's
query heads and its K=V vector); the torch code here is the CPU path and its reference.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from sglang.srt.configs.deepseek_v4 import YarnScaling, yarn_ramp_bounds
from sglang.srt.layers import aiter_ops
from sglang.srt.layers.gpu_kernels import sgl_kernel_op
from sglang.srt.layers.norm import RMSNorm, rms_normalize
from sglang.srt.layers.quantization.fp8 import Fp8Activation
from sglang.srt.layers.quantization.fp8_format import fp8_format


def rope_inv_freq(rope_dim: int, theta: float, yarn: Optional[YarnScaling]) -> torch.Tensor:
    """[rope_dim / 2] fp32 angular frequencies, YaRN-blended when `yarn` is given."""
    idx = torch.arange(0, rope_dim, 2, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (idx / rope_dim))
    if yarn is None:
        return inv_freq
    lo, hi = yarn_ramp_bounds(rope_dim, theta, yarn)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return inv_freq * (1 - ramp) + (inv_freq / yarn.factor) * ramp


class RotaryEmbedding(nn.Module):
    """cos/sin at absolute positions; `apply` rotates (or de-rotates) the trailing rotary slice."""

    def __init__(self, rope_dim: int, theta: float, yarn: Optional[YarnScaling]) -> None:
        super().__init__()
        self.rope_dim, self.theta, self.yarn = rope_dim, theta, yarn
        self.register_buffer("inv_freq", rope_inv_freq(rope_dim, theta, yarn), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the table after the module was materialised from the meta device."""
        self.inv_freq = rope_inv_freq(self.rope_dim, self.theta, self.yarn).to(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor) -> tuple:
        """positions [T] -> (cos, sin), each [T, rope_dim/2] fp32."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos(), freqs.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [T, ..., D]: rotate x[..., D-rope_dim:] by +pos (or -pos when `inverse`) at each row's position."""
        fused = _fused_kernel() if x.is_cuda and x.stride(-1) == 1 else None
        if fused is not None:
            return fused(x, positions, self.inv_freq, inverse)
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin, inverse)

    def apply_normed(self, x: torch.Tensor, positions: torch.Tensor, norm: Union[RMSNorm, float]) -> torch.Tensor:
        """apply(RMSNorm(x), positions): x [T, H, D] query heads under the unweighted norm (`norm` its eps) or x [T, D],
        the K=V vector, under a weighted RMSNorm module. On GPUs one launch that reads x through its strides (a
        joined projection's split view needs no copy); on CPU, and under AITER (its norm), the norm then `apply`."""
        weight, eps = (norm.weight, norm.eps) if isinstance(norm, RMSNorm) else (None, float(norm))
        fused = _fused_norm_rope(x)
        if fused is not None:
            return fused(x, weight, eps, positions, self.inv_freq)
        return self.apply(norm(x) if weight is not None else rms_normalize(x, eps), positions)

    def apply_fp8(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool,
                  path: str) -> Optional[Fp8Activation]:
        """x [T, H, D] -> apply(x, ...).flatten(1) only quantized, for the FP8 linear that reads it (an Fp8Activation
        for `path`), by one sgl_kernel launch that writes no 16-bit copy; None where that kernel does not cover x's
        layout (rope_fp8_supported: DeepSeek-V4's D 512 with 64 rope dims is covered)."""
        from sgl_kernel.dsv4_rope import dsv4_rope_fp8, rope_fp8_supported

        if not rope_fp8_supported(x, self.rope_dim):
            return None
        q, s = dsv4_rope_fp8(x, positions, self.inv_freq, inverse, cublas_layout=path == "cublas_w8a8",
                             fp8_dtype=fp8_format().dtype)
        return Fp8Activation(q, s, x.shape[0], x.dtype, path)


def _fused_kernel():
    """sgl_kernel's Triton RoPE, or None where Triton / sgl_kernel is not installed."""
    return sgl_kernel_op("dsv4_rope", "dsv4_rope")


def _fused_norm_rope(x: torch.Tensor):
    """sgl_kernel's one-launch RMSNorm + RoPE where x is on a GPU (not where AITER runs the norm) and its layout is
    covered; else None."""
    if not x.is_cuda or x.stride(-1) != 1 or x.dim() not in (2, 3) or aiter_ops.use_aiter(x):
        return None
    return sgl_kernel_op("dsv4_qk_norm_rope", "dsv4_qk_norm_rope")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved-pair rotation of the trailing 2*cos.shape[-1] dims of x; cos/sin are [T, R/2]."""
    rope_dim = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
