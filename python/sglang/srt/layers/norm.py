"""RMSNorm (weighted, fp32 math) and the unweighted variant used on query heads and before the mHC mixes.

On ROCm with AITER both run AITER's RMSNorm (layers/aiter_ops.py; same function); on other GPUs sgl_kernel's
one-launch Triton RMSNorm (same fp32 arithmetic); on CPU the torch code here (the reference).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers import aiter_ops
from sglang.srt.layers.gpu_kernels import sgl_kernel_op
from sglang.srt.layers.quantization.fp8 import Fp8Activation
from sglang.srt.layers.quantization.fp8_format import fp8_format


def _fused_kernel():
    """sgl_kernel's Triton RMSNorm, or None where Triton / sgl_kernel is not installed."""
    return sgl_kernel_op("dsv4_rmsnorm", "dsv4_rms_norm")


def _fused(x: torch.Tensor):
    return _fused_kernel() if x.is_cuda and x.stride(-1) == 1 else None


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, computed in fp32, returned in x's dtype."""
    if aiter_ops.use_aiter(x):
        return aiter_ops.rms_norm(x, None, eps)
    fused = _fused(x)
    if fused is not None:
        return fused(x, None, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight multiplies in fp32 and the result is cast back once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._aiter_weights: dict = {}  # dtype -> the weight cast exactly to it (AITER path only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if aiter_ops.use_aiter(x):
            return aiter_ops.rms_norm(x, self.weight, self.eps, self._aiter_weights)
        fused = _fused(x)
        if fused is not None:
            return fused(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)

    def forward_fp8(self, x: torch.Tensor, path: str) -> tuple:
        """x [M, D] -> (RMSNorm(x), the same rows quantized for the FP8 linear that reads them, an Fp8Activation for
        `path`), by one sgl_kernel launch (quantization/fp8.w8a8_input_path says when: a GPU's W8A8 paths)."""
        from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm_fp8

        y, q, s = dsv4_rms_norm_fp8(x, self.weight, self.eps, cublas_layout=path == "cublas_w8a8",
                                    fp8_dtype=fp8_format().dtype)
        return y, Fp8Activation(q, s, x.shape[0], x.dtype, path)
