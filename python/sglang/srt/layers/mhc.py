"""Manifold-constrained hyper-connections (mHC), arch section 4.

Streams S [T, n, D] (n = hc_mult). Per sub-layer, `hc_pre` derives from the flattened, RMS-normalised streams:
pre [T, n] (sigmoid + eps), post [T, n] (2 * sigmoid) and comb [T, n, n] (Sinkhorn-projected, rows = input
stream j, columns = output stream k); it returns the sub-layer input u = sum_j pre_j S_j. `hc_post` then
forms S'_k = post_k * o + sum_j comb[j, k] * S_j. `hc_head` collapses the streams with sigmoid weights only.
All mixing weights are computed in fp32. On GPUs each step runs fused Triton kernels (sgl_kernel.dsv4_mhc): hc_pre
in two launches, hc_post in one, hc_head in two (instead of ~15 for the mixing alone, plus ~130 for a torch
Sinkhorn); `hc_pre_norm`, the decoder layer's entry, folds the sub-layer's RMSNorm (and its FP8 quantization) into
hc_pre's second launch. `hc_post_mixes`, hc_post given the fn of what reads its streams next (the same layer's ffn
fn, the next layer's attn fn, the head's), also writes their partial mixes (a MixPartials) where its kernel runs, so
that the next hc_pre / hc_pre_norm / hc_head (`partials=`) skips its first launch: one launch a sub-layer less.
The torch functions here are the CPU path and the kernels' reference. On ROCm with AITER
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
           sinkhorn_iters: int, hc_eps: float, norm_eps: float, partials=None) -> tuple:
    """streams [T, n, D] -> (u [T, D], post [T, n] fp32, comb [T, n, n] fp32); `partials`: hc_post_mixes's of these
    streams for this fn, or None."""
    if aiter_ops.use_aiter_mhc(streams, fn):
        return aiter_ops.mhc_pre(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps)
    fused = _fused("dsv4_hc_pre", streams)
    if fused is not None:
        return fused(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, partials=partials)
    return hc_pre_ref(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps)


def hc_pre_norm(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                sinkhorn_iters: int, hc_eps: float, norm_eps: float, norm: RMSNorm, fp8_path: Optional[str],
                partials=None) -> tuple:
    """hc_pre, then the sub-layer's `norm` of u -> (norm(u) [T, D], the input of the linear that reads it, post,
    comb). With `fp8_path` (that linear's W8A8 path, quantization/fp8.w8a8_input_path) the input is norm(u) quantized
    as RMSNorm.forward_fp8 gives it, else norm(u) itself. On GPUs the norm (and the quantization) run in hc_pre's
    second launch, u never written: two launches where hc_pre + the norm took three; elsewhere, and where the norm
    is AITER's, hc_pre then the norm, except that AITER's mhc_pre folds the norm in where it can (no W8A8 input:
    AITER's kernel does not quantize). `partials`: as hc_pre's."""
    if fp8_path is None and aiter_ops.use_aiter_mhc(streams, fn):
        weight = aiter_ops.mhc_norm_weight(streams, norm)
        if weight is not None:
            y, post, comb = aiter_ops.mhc_pre(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, weight,
                                              norm.eps)
            return y, y, post, comb
    fused = None if aiter_ops.use_aiter(streams) else _fused("dsv4_hc_pre_norm", streams)
    if fused is None:
        u, post, comb = hc_pre(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, partials)
        if fp8_path is None:
            y = norm(u)
            return y, y, post, comb
        y, x_in = norm.forward_fp8(u, fp8_path)
        return y, x_in, post, comb
    if fp8_path is None:
        y, post, comb = fused(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, norm.weight, norm.eps,
                              partials=partials)
        return y, y, post, comb
    y, post, comb, q, s = sgl_kernel_op("dsv4_mhc", "dsv4_hc_pre_norm_fp8")(
        streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, norm.weight, norm.eps,
        cublas_layout=fp8_path == "cublas_w8a8", fp8_dtype=fp8_format().dtype, partials=partials)
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


# Rows up to which hc_post carries the next mixes (H100, `bench_dsv4_mhc.py --carry`: hc_post + hc_pre_norm in 2
# launches 13.0 / 13.9 us against 13.8 / 17.1 in 3 at T = 1 / 8, but 53.7 against 34.0 us GPU time at T = 128, where
# the carrying hc_post re-reads fn per token block of 32).
CARRY_MAX_ROWS = 16


def hc_post_mixes(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  next_fn: Optional[torch.Tensor]) -> tuple:
    """hc_post -> (new streams, their partial mixes with `next_fn` [M, n*D] for the next hc_pre / hc_pre_norm /
    hc_head, or None). The partials come where our kernels run (GPU tensors, no AITER: AITER's mhc_pre computes its
    own mixes) and up to CARRY_MAX_ROWS rows; elsewhere, or without next_fn, they are None and the callee computes
    its mixes as without them."""
    carry = next_fn is not None and streams.shape[0] <= CARRY_MAX_ROWS and not aiter_ops.use_aiter(streams)
    fused = _fused("dsv4_hc_post_mixes", streams) if carry else None
    if fused is None:
        return hc_post(out, streams, post, comb), None
    return fused(out, streams, post, comb, next_fn)


def hc_post_ref(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hc_post in torch (the CPU path): comb and post rounded to the streams' dtype, a matmul in that dtype."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def hc_head(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            hc_eps: float, norm_eps: float, partials=None) -> torch.Tensor:
    """Collapse streams [T, n, D] -> [T, D] with w_j = sigmoid(a_j * scale + base_j) + eps (no Sinkhorn);
    `partials`: as hc_pre's."""
    if aiter_ops.use_aiter_mhc(streams, fn):
        return aiter_ops.mhc_head(streams, fn, scale, base, hc_eps, norm_eps)
    fused = _fused("dsv4_hc_head", streams)
    if fused is not None:
        return fused(streams, fn, scale, base, hc_eps, norm_eps, partials=partials)
    return hc_head_ref(streams, fn, scale, base, hc_eps, norm_eps)


def hc_head_ref(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                hc_eps: float, norm_eps: float) -> torch.Tensor:
    """hc_head in torch (the CPU path)."""
    a = _mixes(streams, fn, norm_eps)
    w = torch.sigmoid(a * scale.float() + base.float()) + hc_eps
    return (w.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def mix_partials_ref(streams: torch.Tensor, fn: torch.Tensor, chunk: int, width: int) -> torch.Tensor:
    """The partial mixes of streams [T, n, D] with fn [M, n*D] in torch fp32, over D chunks of `chunk` columns of
    every stream: [T, C, width], per chunk the M dot products and (column M) the sum of squares, zero past it."""
    t, n, d = streams.shape
    rows = fn.shape[0]
    x = streams.float()
    w = fn.float().view(rows, n, d)
    part = x.new_zeros(t, -(-d // chunk), width)
    for c, d0 in enumerate(range(0, d, chunk)):
        xs, ws = x[:, :, d0:d0 + chunk], w[:, :, d0:d0 + chunk]
        part[:, c, :rows] = xs.flatten(1) @ ws.flatten(1).t()
        part[:, c, rows] = xs.square().sum((1, 2))
    return part


def hc_post_mixes_ref(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      fn: torch.Tensor, chunk: int, width: int) -> tuple:
    """hc_post_mixes in torch fp32: (the new streams (fp32 products and sums, one rounding to the streams' dtype),
    mix_partials_ref of those rounded streams)."""
    new = hc_post_ref(out.float(), streams.float(), post, comb).to(streams.dtype)
    return new, mix_partials_ref(new, fn, chunk, width)
