"""dsv4_rms_norm against the engine's torch RMSNorm (sglang.srt.layers.norm): weighted and unweighted, fp32 and fp16
inputs, a non-power-of-two width, strided rows (query heads), zero rows. GPU (skipped without CUDA): bf16 at
DeepSeek-V4 widths and the dispatch from RMSNorm / rms_normalize."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm
from sglang.srt.layers import norm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _torch_norm(x, weight, eps):
    m = norm.RMSNorm(x.shape[-1], eps).to(x.device)
    if weight is None:
        return norm.rms_normalize(x, eps)
    m.weight.data.copy_(weight)
    return m(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("d", [64, 96])
def test_matches_torch(dtype, weighted, d):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(7, 3, d, generator=g) * 3).to(dtype)
    w = torch.randn(d, generator=g) if weighted else None
    got = dsv4_rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, _torch_norm(x, w, 1e-6), atol=1e-5 if dtype == torch.float32 else 1e-3,
                               rtol=1e-5 if dtype == torch.float32 else 1e-3)


def test_strided_rows_and_zero_rows():
    x = torch.randn(5, 8, 64)
    heads = x[:, 2:6]  # rows with stride 8 * 64, last dim contiguous
    torch.testing.assert_close(dsv4_rms_norm(heads, None, 1e-6), _torch_norm(heads, None, 1e-6))
    assert dsv4_rms_norm(torch.randn(0, 64), None, 1e-6).shape == (0, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [512, 4096, 7168])
def test_gpu_bf16_and_dispatch(d):
    x = torch.randn(300, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(d, device="cuda")
    ref = (w * (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6))).bfloat16()
    got = dsv4_rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=1e-2)
    assert norm._fused(x) is dsv4_rms_norm  # the engine's RMSNorm takes this path on CUDA
    torch.testing.assert_close(_torch_norm(x, w, 1e-6).float(), got.float(), atol=0, rtol=0)
