"""dsv4_hc_mix (fused mHC pre / post / Sinkhorn weights) against the engine's torch path `hc_mix_weights`.

CPU (Triton interpreter): n = 4 (DeepSeek-V4) and n = 3 (padded to 4), 1 and 20 Sinkhorn rounds, row counts that
leave a partial block, zero rows; every comb column sums to 1. GPU (skipped without CUDA):
4096 rows at n = 4, 20 rounds, and `hc_pre` dispatching to the kernel.
"""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_mhc import dsv4_hc_mix
from sglang.srt.layers.mhc import hc_mix_weights

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(t: int, n: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, 2 * n + n * n, generator=g) * 2
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(2 * n + n * n, generator=g)
    return z.to(device), scale.to(device), base.to(device)


def _compare(t, n, iters, seed, device="cpu", atol=1e-6):
    z, scale, base = _inputs(t, n, seed, device)
    got = dsv4_hc_mix(z, scale, base, n, iters, 1e-6)
    ref = hc_mix_weights(z, scale, base, n, iters, 1e-6)
    for name, a, b in zip(("pre", "post", "comb"), got, ref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    return got


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("iters", [1, 20])
@pytest.mark.parametrize("t", [1, 70])
def test_matches_torch(t, n, iters):
    _, _, comb = _compare(t, n, iters, seed=t * 10 + n + iters)
    # the last Sinkhorn step normalises columns (rows converge only approximately for peaked logits)
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(t, n), atol=1e-3, rtol=0)  # (up to eps / column sum)


def test_zero_rows():
    pre, post, comb = dsv4_hc_mix(*_inputs(0, 4, 0), 4, 20, 1e-6)
    assert pre.shape == (0, 4) and post.shape == (0, 4) and comb.shape == (0, 4, 4)


def test_rejects_bad_arguments():
    z, scale, base = _inputs(3, 4, 0)
    with pytest.raises(AssertionError, match="z must be"):
        dsv4_hc_mix(z[:, :20], scale, base, 4, 20, 1e-6)
    with pytest.raises(AssertionError, match="iterations"):
        dsv4_hc_mix(z, scale, base, 4, 0, 1e-6)


@pytest.mark.gpu
@needs_cuda
def test_gpu_flash_shape_and_dispatch(monkeypatch):
    _compare(4096, 4, 20, seed=1, device="cuda", atol=1e-5)
    import sglang.srt.layers.mhc as mhc

    calls = []
    real = mhc._fused_kernel()
    assert real is dsv4_hc_mix  # hc_pre uses the kernel on CUDA
    monkeypatch.setattr(mhc, "_fused_kernel", lambda: (lambda *a: calls.append(1) or real(*a)))
    streams = torch.randn(5, 4, 64, device="cuda", dtype=torch.bfloat16)
    fn = torch.randn(24, 4 * 64, device="cuda")
    u, post, comb = mhc.hc_pre(streams, fn, torch.ones(3, device="cuda"), torch.zeros(24, device="cuda"), 20, 1e-6,
                               1e-6)
    assert calls and u.shape == (5, 64) and comb.shape == (5, 4, 4)
