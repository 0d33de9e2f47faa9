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


@pytest.mark.parametrize("shape,rope", [((37, 2, 128), 32), ((5, 2, 256), 64), ((3, 3, 512), 128), ((2, 1, 128), 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cublas_layout", [False, True])
def test_fp8_output_is_rope_then_act_quant(shape, rope, dtype, cublas_layout):
    """dsv4_rope_fp8 writes, bit for bit, what dsv4_fp8_act_quant makes of the inverse RoPE's result (codes and
    multipliers, in either layout): rows past one program's 32, heads of one to four blocks, rope dims filling the
    last block or a part of it, a pair count below a power of two."""
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant
    from sgl_kernel.dsv4_rope import dsv4_rope_fp8

    g = torch.Generator().manual_seed(shape[2] + rope)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 5000, (shape[0],), generator=g)
    inv = RotaryEmbedding(rope, 10000.0, None).inv_freq
    q, s = dsv4_rope_fp8(x, positions, inv, inverse=True, cublas_layout=cublas_layout)
    rq, rs = dsv4_fp8_act_quant(dsv4_rope(x, positions, inv, inverse=True).flatten(1), cublas_layout=cublas_layout)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and q.shape == rq.shape
    assert torch.equal(s, rs) and s.stride() == rs.stride()


def test_fp8_output_refuses_partial_blocks():
    from sgl_kernel.dsv4_rope import dsv4_rope_fp8

    with pytest.raises(ValueError, match="multiple of 128"):
        dsv4_rope_fp8(torch.randn(3, 4, 96), torch.zeros(3, dtype=torch.int64), torch.ones(16))
    with pytest.raises(ValueError, match="inside the last 128"):
        dsv4_rope_fp8(torch.randn(3, 1, 256), torch.zeros(3, dtype=torch.int64), torch.ones(96))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cublas_layout", [False, True])
def test_gpu_fp8_output(cublas_layout):
    """Flash's attention output [T, 64, 512], rope 64: within one e4m3 step of rope + act quant (the GPU may contract
    the rotation into FMAs in either kernel), the multipliers equal but where such a step crosses a power of two."""
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant
    from sgl_kernel.dsv4_rope import dsv4_rope_fp8

    x = torch.randn(300, 64, 512, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 60000, (300,), device="cuda")
    inv = RotaryEmbedding(64, 10000.0, None).inv_freq.cuda()
    q, s = dsv4_rope_fp8(x, positions, inv, inverse=True, cublas_layout=cublas_layout)
    rq, rs = dsv4_fp8_act_quant(dsv4_rope(x, positions, inv, inverse=True).flatten(1), cublas_layout=cublas_layout)
    assert s.stride() == rs.stride() and (s != rs).float().mean() < 1e-3
    deq = (q[:300].float().view(300, -1, 128) * s[:300, :, None]).flatten(1)
    ref = (rq[:300].float().view(300, -1, 128) * rs[:300, :, None]).flatten(1)
    assert ((deq - ref).abs() <= ref.abs() / 8 + 1e-30).all()  # e4m3: 3 mantissa bits
    assert (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean() < 1e-3
