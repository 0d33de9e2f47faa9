"""dsv4_rope against the engine's torch RoPE (sglang.srt.layers.rotary): heads and flat rows, a nope part and a
rope-only head, the inverse rotation, YaRN frequencies, fp16, zero rows. GPU (skipped without CUDA): bf16 at
DeepSeek-V4 shapes and the dispatch from RotaryEmbedding.apply."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_rope import dsv4_rope
from sglang.srt.layers.rotary import RotaryEmbedding, apply_rotary

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _torch(rot: RotaryEmbedding, x, positions, inverse):
    cos, sin = rot.cos_sin(positions)
    return apply_rotary(x, cos, sin, inverse)


@pytest.mark.parametrize("shape,rope", [((5, 3, 48), 16), ((6, 32), 32), ((4, 2, 2, 40), 8)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_torch(shape, rope, inverse, dtype):
    rot = RotaryEmbedding(rope, 10000.0, None)
    x = torch.randn(shape).to(dtype)
    positions = torch.randint(0, 5000, (shape[0],))
    got = dsv4_rope(x, positions, rot.inv_freq, inverse)
    torch.testing.assert_close(got, _torch(rot, x, positions, inverse), atol=2e-4 if dtype == torch.float32 else 2e-3,
                               rtol=1e-4 if dtype == torch.float32 else 2e-3)


def test_inverse_undoes_and_zero_rows():
    rot = RotaryEmbedding(16, 10000.0, None)
    x = torch.randn(7, 4, 64)
    pos = torch.arange(7) * 100
    torch.testing.assert_close(dsv4_rope(dsv4_rope(x, pos, rot.inv_freq), pos, rot.inv_freq, inverse=True), x,
                               atol=1e-5, rtol=1e-5)
    assert dsv4_rope(torch.randn(0, 4, 64), pos[:0], rot.inv_freq).shape == (0, 4, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(300, 64, 512), (300, 512), (17, 64, 128)])
def test_gpu_bf16_and_dispatch(shape):
    rot = RotaryEmbedding(64, 160000.0, None).cuda()
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 1 << 20, (shape[0],), device="cuda")
    ref = _torch(rot, x, pos, False)
    got = rot.apply(x, pos)  # dispatches to dsv4_rope on CUDA
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got, dsv4_rope(x, pos, rot.inv_freq))
