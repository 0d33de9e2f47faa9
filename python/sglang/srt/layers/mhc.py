"""Manifold-constrained hyper-connections (mHC), arch section 4.

Streams S [T, n, D] (n = hc_mult). Per sub-layer, `hc_pre` derives from the flattened, RMS-normalised streams:
pre [T, n] (sigmoid + eps), post [T, n] (2 * sigmoid) and comb [T, n, n] (Sinkhorn-projected, rows = input
stream j, columns = output stream k); it returns the sub-layer input u = sum_j pre_j S_j. `hc_post` then
forms S'_k = post_k * o + sum_j comb[j, k] * S_j. `hc_head` collapses the streams with sigmoid weights only.
All mixing weights are computed in fp32. On GPUs each step runs fused Triton kernels (sgl_kernel.dsv4_mhc): hc_pre
in two launches, hc_post in one, hc_head in two (instead of ~15 for the mixing alone, plus ~130 for a torch
Sinkhorn); `hc_pre_norm`, the decoder layer's entry, folds the sub-layer's RMSNorm (and its FP8 quantization) into
hc_pre's second launch. The torch functions here are the CPU path and the kernels' reference. On ROCm with AITER
(layers/aiter_ops.py), bf16 streams of DeepSeek-V4's widths run AITER's HIP mhc_pre / mhc_post instead: the same
functions. hc_post's kernel keeps fp32 math with one rounding to the streams' dtype, where the torch path rounds
comb / post to that dtype first: in bf16 the two differ by bf16 roundings, in fp32 by summation order only.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers import aiter_ops
from sglang.srt.layers.gpu_kernels import sgl_kernel_op
from sglang.srt.layers.norm import RMSNorm
from sglang.srt.layers.quantization.fp8 import Fp8Activation
from sglang.srt.layers.quantization.fp8_format import fp8_format


def _mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """(fn . f) / rms(f) for the flattened streams f [T, n*D] -> [T, rows(fn)] fp32."""
    flat = streams.flatten(1).float()
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return (flat * inv_rms) @ fn.float().t()


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax (+eps), then alternate column/row normalisation, ending on a column normalisation."""
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mix_weights(z: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
                   eps: float) -> tuple:
    """Mixes z [T, 2n + n*n] fp32 -> (pre [T, n], post [T, n], comb [T, n, n]) fp32, in torch."""
    z_pre, z_post, z_comb = z.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.float().split([n, n, n * n])
    scale = scale.float()
    pre = torch.sigmoid(z_pre * scale[0] + b_pre) + eps
    post = 2 * torch.sigmoid(z_post * scale[1] + b_post)
    comb = sinkhorn((z_comb * scale[2] + b_comb).view(-1, n, n), iters, eps)
    return pre, post, comb


def _fused(name: str, streams: torch.Tensor):
    """sgl_kernel.dsv4_mhc.<name> for GPU tensors (CUDA and ROCm), None on CPU (the interpreter is slow) or where
    Triton / sgl_kernel is not installed."""
    return sgl_kernel_op("dsv4_mhc", name) if streams.is_cuda else None


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> tuple:
    """streams [T, n, D] -> (u [T, D], post [T, n] fp32, comb [T, n, n] fp32)."""
    if aiter_ops.use_aiter_mhc(streams, fn):
        return aiter_ops.mhc_pre(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps)
    fused = _fused("dsv4_hc_pre", streams)
    if fused is not None:
        return fused(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps)
    return hc_pre_ref(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps)


def hc_pre_norm(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                sinkhorn_iters: int, hc_eps: float, norm_eps: float, norm: RMSNorm, fp8_path: Optional[str]) -> tuple:
    """hc_pre, then the sub-layer's `norm` of u -> (norm(u) [T, D], the input of the linear that reads it, post,
    comb). With `fp8_path` (that linear's W8A8 path, quantization/fp8.w8a8_input_path) the input is norm(u) quantized
    as RMSNorm.forward_fp8 gives it, else norm(u) itself. On GPUs the norm (and the quantization) run in hc_pre's
    second launch, u never written: two launches where hc_pre + the norm took three; elsewhere, and where the norm
    is AITER's, hc_pre then the norm, except that AITER's mhc_pre folds the norm in where it can (no W8A8 input:
    AITER's kernel does not quantize)."""
    if fp8_path is None and aiter_ops.use_aiter_mhc(streams, fn):
        weight = aiter_ops.mhc_norm_weight(streams, norm)
        if weight is not None:
            y, post, comb = aiter_ops.mhc_pre(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, weight,
                                              norm.eps)
            return y, y, post, comb
    fused = None if aiter_ops.use_aiter(streams) else _fused("dsv4_hc_pre_norm", streams)
    if fused is None:
        u, post, comb = hc_pre(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps)
        if fp8_path is None:
            y = norm(u)
            return y, y, post, comb
        y, x_in = norm.forward_fp8(u, fp8_path)
        return y, x_in, post, comb
    if fp8_path is None:
        y, post, comb = fused(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, norm.weight, norm.eps)
        return y, y, post, comb
    y, post, comb, q, s = sgl_kernel_op("dsv4_mhc", "dsv4_hc_pre_norm_fp8")(
        streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, norm.weight, norm.eps,
        cublas_layout=fp8_path == "cublas_w8a8", fp8_dtype=fp8_format().dtype)
    return y, Fp8Activation(q, s, y.shape[0], y.dtype, fp8_path), post, comb


def hc_pre_ref(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
               sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> tuple:
    """hc_pre in torch (the CPU path)."""
    n = streams.shape[1]
    z = _mixes(streams, fn, norm_eps)
    pre, post, comb = hc_mix_weights(z, scale, base, n, sinkhorn_iters, hc_eps)
    u = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return u, post, comb


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out [T, D], streams [T, n, D] -> new streams [T, n, D]: post (x) out + comb^T . streams."""
    if aiter_ops.use_aiter_mhc(streams, api="mhc_post"):
        return aiter_ops.mhc_post(out, streams, post, comb)
    fused = _fused("dsv4_hc_post", streams)
    if fused is not None:
        return fused(out, streams, post, comb)
    return hc_post_ref(out, streams, post, comb)


def hc_post_ref(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hc_post in torch (the CPU path): comb and post rounded to the streams' dtype, a matmul in that dtype."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def hc_head(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Collapse streams [T, n, D] -> [T, D] with w_j = sigmoid(a_j * scale + base_j) + eps (no Sinkhorn)."""
    if aiter_ops.use_aiter_mhc(streams, fn):
        return aiter_ops.mhc_head(streams, fn, scale, base, hc_eps, norm_eps)
    fused = _fused("dsv4_hc_head", streams)
    if fused is not None:
        return fused(streams, fn, scale, base, hc_eps, norm_eps)
    return hc_head_ref(streams, fn, scale, base, hc_eps, norm_eps)


def hc_head_ref(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                hc_eps: float, norm_eps: float) -> torch.Tensor:
    """hc_head in torch (the CPU path)."""
    a = _mixes(streams, fn, norm_eps)
    w = torch.sigmoid(a * scale.float() + base.float()) + hc_eps
    return (w.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
