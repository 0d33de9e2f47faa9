"""The fused mHC kernels (sgl_kernel.dsv4_mhc) against the engine's torch path (sglang.srt.layers.mhc, *_ref).

dsv4_hc_mix (pre / post / Sinkhorn weights from the mixes): n = 4 and n = 3 (padded to 4), 1 and 20 Sinkhorn rounds,
partial blocks, zero rows. dsv4_hc_pre (two launches), dsv4_hc_post (one), dsv4_hc_head (two): n = 4 / 3, D = 48 / 40
(not a power of two, a partial tile), T = 1 / 5 / 63, fp32 and bf16; more D chunks than one partial-sum step, several u
steps and hc_post blocks; strided streams; the mixes as bf16 MMAs and the finish's Sinkhorn in 64-token programs (both
forced on); zero tokens; no host reads and no torch compute ops (graph-capturable, launch counts). bf16 is compared with
the fp32 torch path before its rounding: the interpreter's bf16 casts truncate (one ulp), a GPU rounds to nearest (half
an ulp). GPU (skipped without CUDA): Flash widths (n 4, D 4096, T 1 / 8 / 32 / 128, bf16), the layer dispatching to the
kernels, pre -> post -> head captured as a CUDA graph, and the bf16-MMA mixes against the FMA dot's at 32 / 128 / 8,192
rows.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sgl_kernel.dsv4_mhc as kernels
from sgl_kernel.dsv4_mhc import (dsv4_hc_head, dsv4_hc_mix, dsv4_hc_post, dsv4_hc_pre, dsv4_hc_pre_norm,
                                 dsv4_hc_pre_norm_fp8, mixes_launch)
from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm_fp8
from sglang.srt.layers import mhc
from sglang.srt.layers.mhc import hc_head_ref, hc_mix_weights, hc_post_ref, hc_pre_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 values (8 significant bits)


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


# ----------------------------------------------------------------------------- hc_pre / hc_post / hc_head


def _layer(t: int, n: int, d: int, seed: int, dtype=torch.float32, device="cpu", head=False) -> tuple:
    """streams [T, n, D] in `dtype`, a sub-layer's (or with `head` the head's) fn / scale / base, a sub-layer output
    o [T, D] in `dtype`; fn scaled so the mixes are O(1), as trained ones are."""
    g = torch.Generator().manual_seed(seed)
    rows = n if head else 2 * n + n * n
    streams = torch.randn(t, n, d, generator=g) * 2
    fn = torch.randn(rows, n * d, generator=g) * (n * d) ** -0.5 * 2
    scale = torch.rand(1 if head else 3, generator=g) + 0.5
    base = torch.randn(rows, generator=g)
    out = torch.randn(t, d, generator=g)
    return tuple(x.to(device) for x in (streams.to(dtype), fn, scale, base, out.to(dtype)))


def _assert_rounded(got: torch.Tensor, ref32: torch.Tensor, name: str, gpu: bool = False) -> None:
    """got in its dtype against the fp32 result: fp32 to summation order, bf16 to one rounding of it (plus the
    weights' own summation-order differences)."""
    assert got.dtype in (torch.float32, torch.bfloat16) and got.shape == ref32.shape, name
    rtol = 1e-5 if got.dtype == torch.float32 else BF16_ULP / (2 if gpu else 1) + 1e-4
    torch.testing.assert_close(got.float(), ref32, rtol=rtol, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _check_pre(streams, fn, scale, base, gpu=False) -> tuple:
    got = dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    u, post, comb = hc_pre_ref(streams.float(), fn, scale, base, 20, 1e-6, 1e-6)  # u before its rounding
    _assert_rounded(got[0], u, "u", gpu)
    assert got[0].dtype == streams.dtype
    tol = dict(rtol=1e-4, atol=1e-5) if gpu else dict(rtol=1e-5, atol=1e-6)  # GPU: sums of 16,384 products
    torch.testing.assert_close(got[1], post, **tol)
    torch.testing.assert_close(got[2], comb, **tol)
    return got


def _check_post(out, streams, post, comb, gpu=False) -> torch.Tensor:
    got = dsv4_hc_post(out, streams, post, comb)
    assert got.dtype == streams.dtype and got.is_contiguous()
    _assert_rounded(got, hc_post_ref(out.float(), streams.float(), post, comb), "new streams", gpu)
    return got


def _check_head(streams, fn, scale, base, gpu=False) -> torch.Tensor:
    got = dsv4_hc_head(streams, fn, scale, base, 1e-6, 1e-6)
    assert got.dtype == streams.dtype
    _assert_rounded(got, hc_head_ref(streams.float(), fn, scale, base, 1e-6, 1e-6), "head", gpu)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 5, 63])
@pytest.mark.parametrize("n,d", [(4, 48), (3, 40)])
def test_pre_post_head_match_torch(n, d, t, dtype):
    """D 48: two 32-column tiles (two D chunks at decode, one chunk of two tiles past 16 tokens); D 40: a partial
    tile; n 3: padded streams and Sinkhorn entries; 63 tokens: a partial token block."""
    streams, fn, scale, base, out = _layer(t, n, d, seed=t * 100 + n, dtype=dtype)
    _, post, comb = _check_pre(streams, fn, scale, base)
    new = _check_post(out, streams, post, comb)
    if dtype == torch.float32:  # the torch path itself: fp32 everywhere, summation order only
        torch.testing.assert_close(new, hc_post_ref(out, streams, post, comb), rtol=1e-5, atol=1e-5)
    head = _layer(t, n, d, seed=t + n, dtype=dtype, head=True)
    _check_head(new, *head[1:4])


@pytest.mark.parametrize("t,n,d", [(17, 4, 48), (63, 3, 40)])
def test_split_mixes_match_torch(monkeypatch, t, n, d):
    """The mixes as bf16 MMAs (SPLIT, past 16 rows): fn's three bf16 parts sum to it exactly, so pre / post / comb /
    u / head agree with the fp32 torch path as the FMA dot's do (the interpreter dots the parts as fp32: its bf16 dot
    is wrong; the GPU test runs the MMAs)."""
    launched = []
    real = kernels._dsv4_hc_mixes_kernel.run
    monkeypatch.setattr(kernels._dsv4_hc_mixes_kernel, "run", lambda *a, **k: launched.append(k["SPLIT"]) or real(
        *a, **k))
    monkeypatch.setattr(kernels, "SPLIT_MIN_ROWS", 16)
    streams, fn, scale, base, out = _layer(t, n, d, seed=t + d, dtype=torch.bfloat16)
    _, post, comb = _check_pre(streams, fn, scale, base)
    new = _check_post(out, streams, post, comb)
    _check_head(new, *_layer(t, n, d, seed=t, dtype=torch.bfloat16, head=True)[1:4])
    assert launched == [True, True]
    assert not kernels.split_mixes(streams[:16]) and not kernels.split_mixes(streams.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocked_finish_matches_torch(monkeypatch, dtype):
    """hc_pre's post and Sinkhorn comb in 64-token programs (forced on at 70 rows: by default past 2,048): the same u
    (and norm(u)) bit for bit as a finish program a token, post and comb to fp32 summation order, and both against
    the torch path; 70 rows: a partial 64-token block."""
    monkeypatch.setattr(kernels, "FINISH_BLOCKED_MIN_ROWS", None)
    streams, fn, scale, base, _ = _layer(70, 3, 40, seed=9, dtype=dtype)
    weight = torch.randn(40).to(dtype)
    per_token = dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    normed = dsv4_hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)
    monkeypatch.setattr(kernels, "FINISH_BLOCKED_MIN_ROWS", 16)
    launched = []
    real = kernels._dsv4_hc_mix_kernel.run
    monkeypatch.setattr(kernels._dsv4_hc_mix_kernel, "run", lambda *a, **k: launched.append(1) or real(*a, **k))
    blocked = _check_pre(streams, fn, scale, base)
    assert launched == [1]
    assert torch.equal(blocked[0], per_token[0])
    for got, ref in zip(blocked[1:], per_token[1:]):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(dsv4_hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)[0], normed[0])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [32, 128, 8192])
def test_gpu_split_mixes_match_the_fma_dot(monkeypatch, t):
    """Flash widths on a GPU: hc_pre_norm_fp8 with the mixes as bf16 MMAs against the FMA dot's. The tensor cores'
    fp32 accumulation is coarser than the FMAs' (one H100: mixes within 1.6e-6 of sum |x w| against 1.5e-7 at 8,192
    rows), so post and comb agree to 1e-4, u (values up to ~20) to a bf16 rounding plus 5e-3 where it is near 0 (the
    weights' ~3e-5 times streams up to ~11, four of them), norm(u) to two (u's, then its own) plus 5e-3 times the
    norm's weight; u, post and comb likewise against the fp32 torch path."""
    streams, fn, scale, base, _ = _layer(t, 4, 4096, seed=t + 5, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(4096, generator=torch.Generator().manual_seed(t)).bfloat16().cuda()
    monkeypatch.setattr(kernels, "SPLIT_MIN_ROWS", None)
    fma = dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)
    monkeypatch.setattr(kernels, "SPLIT_MIN_ROWS", 16)
    assert kernels.split_mixes(streams)
    mma = dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)
    torch.testing.assert_close(mma[1], fma[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mma[2], fma[2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mma[0].float(), fma[0].float(), rtol=2 * BF16_ULP, atol=5e-3)
    u, post, comb = dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    u_ref, post_ref, comb_ref = hc_pre_ref(streams.float(), fn, scale, base, 20, 1e-6, 1e-6)
    torch.testing.assert_close(u.float(), u_ref, rtol=BF16_ULP / 2 + 1e-4, atol=5e-3)
    torch.testing.assert_close(post, post_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(comb, comb_ref, rtol=1e-4, atol=1e-4)


def test_many_chunks_strided_streams(monkeypatch):
    """D 1,064 at decode: 34 D chunks (two partial-sum steps of 32, the second masked), u in five 256-column steps
    (the last partial), hc_post in five blocks; streams and o as strided views (a [T, n + 1, D] buffer's last n
    streams, o every other row of a wider buffer)."""
    monkeypatch.setattr(kernels, "U_BLOCK_D", 256)
    n, d = 3, 1064
    assert mixes_launch(1, d).chunks == 34
    streams, fn, scale, base, _ = _layer(2, n, d, seed=7)
    wide = torch.randn(2, n + 1, d)
    wide[:, 1:] = streams
    view = wide[:, 1:]
    out = torch.randn(2, 2 * d)[:, ::2].contiguous()[:, :d]  # contiguous rows of its own
    out_view = torch.randn(2, 3 * d)[:, d:2 * d]
    out_view.copy_(out)
    _, post, comb = _check_pre(view, fn, scale, base)
    torch.testing.assert_close(dsv4_hc_post(out_view, view, post, comb), _check_post(out, streams, post, comb),
                               rtol=0, atol=0)


def test_launch_grid():
    """Decode spreads fn over ~256 programs of one 32-column tile; past 16 tokens a program takes two tiles at least,
    so the partials stay small beside the streams."""
    assert mixes_launch(1, 4096) == kernels.MixesLaunch(block_t=16, block_d=32, d_tiles=1, chunks=128,
                                                       num_warps=4)
    assert mixes_launch(8, 4096) == mixes_launch(1, 4096)
    assert mixes_launch(128, 4096) == kernels.MixesLaunch(block_t=64, block_d=32, d_tiles=2, chunks=64,
                                                         num_warps=8)
    assert mixes_launch(4096, 4096) == kernels.MixesLaunch(block_t=64, block_d=32, d_tiles=32, chunks=4,
                                                          num_warps=8)
    assert mixes_launch(1, 8) == kernels.MixesLaunch(block_t=16, block_d=16, d_tiles=1, chunks=1,
                                                    num_warps=4)


def test_zero_tokens_and_bad_arguments():
    streams, fn, scale, base, out = _layer(0, 4, 48, seed=0)
    u, post, comb = dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    assert u.shape == (0, 48) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert dsv4_hc_post(out, streams, post, comb).shape == (0, 4, 48)
    assert dsv4_hc_head(streams, fn[:4], scale[:1], base[:4], 1e-6, 1e-6).shape == (0, 48)
    streams, fn, scale, base, out = _layer(2, 4, 48, seed=0)
    with pytest.raises(AssertionError, match="fn must be"):
        dsv4_hc_pre(streams, fn[:, :96], scale, base, 20, 1e-6, 1e-6)
    with pytest.raises(AssertionError, match="streams must be"):
        dsv4_hc_pre(streams.transpose(1, 2), fn, scale, base, 20, 1e-6, 1e-6)
    with pytest.raises(AssertionError, match="iterations"):
        dsv4_hc_pre(streams, fn, scale, base, 0, 1e-6, 1e-6)
    with pytest.raises(AssertionError, match="scale"):
        dsv4_hc_head(streams, fn[:4], scale, base[:4], 1e-6, 1e-6)
    with pytest.raises(AssertionError, match="comb"):
        dsv4_hc_post(out, streams, torch.ones(2, 4), torch.ones(2, 4, 4).transpose(1, 2))


class _OpCounter(TorchDispatchMode):
    """The torch ops called outside kernel launches (the interpreter's own copies inside a launch are not ours)."""

    def __init__(self):
        super().__init__()
        self.ops, self.in_launch = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_launch:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def launch(self, run, *args, **kwargs):
        self.in_launch = True
        try:
            return run(*args, **kwargs)
        finally:
            self.in_launch = False


def test_launches_only_kernels_and_reads_nothing_back(monkeypatch):
    """Graph-capturable and few launches: hc_pre is two kernel launches, hc_post one, hc_head two, beside output
    allocations only (no torch compute op, no copy); no tensor is read on the host (.item(), .tolist(), bool(), ...)."""
    streams, fn, scale, base, out = _layer(3, 4, 48, seed=1)
    head = _layer(3, 4, 48, seed=2, head=True)
    _, post, comb = dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)  # compiled (interpreted) once
    launches, reads, counter = [], [], _OpCounter()
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            real = getattr(torch.Tensor, name)
            m.setattr(torch.Tensor, name, lambda t, *a, _name=name, _real=real, **k: reads.append(_name) or
                      _real(t, *a, **k))
        for kernel in (kernels._dsv4_hc_mixes_kernel, kernels._dsv4_hc_pre_kernel, kernels._dsv4_hc_post_kernel):
            real = kernel.run
            m.setattr(kernel, "run", lambda *a, _real=real, _name=kernel.fn.__name__, **k: launches.append(_name) or
                      counter.launch(_real, *a, **k))
        bool(torch.tensor(1))  # the guard sees a read (positive control)
        with counter:
            dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
            dsv4_hc_post(out, streams, post, comb)
            dsv4_hc_head(streams, *head[1:4], 1e-6, 1e-6)
    assert reads == ["__bool__"]
    assert launches == ["_dsv4_hc_mixes_kernel", "_dsv4_hc_pre_kernel", "_dsv4_hc_post_kernel",
                        "_dsv4_hc_mixes_kernel", "_dsv4_hc_pre_kernel"]
    assert set(counter.ops) <= {"aten.empty", "aten.empty_like"}, counter.ops


def test_cpu_tensors_keep_the_torch_path():
    """The layer dispatches to the kernels for GPU tensors only: on CPU it is the torch code, exactly."""
    streams, fn, scale, base, out = _layer(5, 4, 48, seed=3)
    assert mhc._fused("dsv4_hc_pre", streams) is None
    got = mhc.hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    for a, b in zip(got, hc_pre_ref(streams, fn, scale, base, 20, 1e-6, 1e-6)):
        assert torch.equal(a, b)
    assert torch.equal(mhc.hc_post(out, streams, got[1], got[2]), hc_post_ref(out, streams, got[1], got[2]))


# ----------------------------------------------------------------------------- hc_pre + the sub-layer's RMSNorm


def _norm_ref(u: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """RMSNorm of u (fp32 values of `dtype`) as the norm layer's torch path computes it, before its rounding."""
    y = u * torch.rsqrt(u.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else weight.float() * y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n,d,weighted", [(1, 4, 48, True), (5, 3, 40, False), (3, 4, 200, True)])
def test_pre_norm_matches_torch(t, n, d, weighted, dtype):
    """hc_pre with the norm folded in: norm(u) against the torch path (u rounded to the streams' dtype, then the
    norm), post and comb exactly dsv4_hc_pre's. D 40 / 200: a row that is not a power of two; n 3: padded streams."""
    streams, fn, scale, base, _ = _layer(t, n, d, seed=t * 7 + d, dtype=dtype)
    weight = torch.randn(d, generator=torch.Generator().manual_seed(d)).to(dtype) if weighted else None
    y, post, comb = dsv4_hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)
    assert y.dtype == dtype and y.shape == (t, d)
    u, want_post, want_comb = dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    torch.testing.assert_close(u.float(), hc_pre_ref(streams.float(), fn, scale, base, 20, 1e-6, 1e-6)[0],
                               rtol=BF16_ULP + 1e-4 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    _assert_rounded(y, _norm_ref(u.float(), weight, 1e-5), "norm(u)")  # the norm of u as hc_pre gives it
    assert torch.equal(post, want_post) and torch.equal(comb, want_comb)


@pytest.mark.parametrize("cublas_layout", [False, True])
def test_pre_norm_fp8_quantizes_its_result(cublas_layout):
    """The quantized variant: its norm(u) equals the plain variant's, its codes and multipliers are
    dsv4_rms_norm_fp8's of that row (the codes act_quant would give), in either multiplier layout; 3 tokens (the
    cuBLAS layout pads to 4 rows)."""
    streams, fn, scale, base, _ = _layer(3, 4, 256, seed=11, dtype=torch.float16)
    weight = torch.randn(256, generator=torch.Generator().manual_seed(1)).half()
    y, post, comb, q, qs = dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5,
                                                cublas_layout)
    plain = dsv4_hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)
    assert torch.equal(y, plain[0]) and torch.equal(post, plain[1]) and torch.equal(comb, plain[2])
    u = dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)[0]
    y_ref, q_ref, qs_ref = dsv4_rms_norm_fp8(u, weight, 1e-5, cublas_layout=cublas_layout)
    assert torch.equal(y, y_ref)  # interpreted, the same row (on a GPU the sums of squares may differ in order)
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(qs, qs_ref) and qs.stride() == qs_ref.stride()
    with pytest.raises(ValueError, match="multiple of 128"):
        dsv4_hc_pre_norm_fp8(*_layer(2, 4, 48, seed=0)[:4], 20, 1e-6, 1e-6, None, 1e-5)


def test_pre_norm_two_launches_side_by_side_roles(monkeypatch):
    """hc_pre_norm(_fp8) is hc_pre's two launches, beside output allocations only; the second launch runs a
    program pair per token (u and its norm beside post and the Sinkhorn), hc_head's one program per token."""
    streams, fn, scale, base, _ = _layer(3, 4, 128, seed=4)
    head = _layer(3, 4, 128, seed=5, head=True)
    dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, None, 1e-5)  # compiled (interpreted) once
    launches, counter = [], _OpCounter()
    with monkeypatch.context() as m:
        for kernel in (kernels._dsv4_hc_mixes_kernel, kernels._dsv4_hc_pre_kernel):
            real = kernel.run
            m.setattr(kernel, "run", lambda *a, _real=real, _name=kernel.fn.__name__, **k: launches.append(
                (_name, tuple(k["grid"]))) or counter.launch(_real, *a, **k))
        with counter:
            dsv4_hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, None, 1e-5)
            dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, None, 1e-5)
            dsv4_hc_head(streams, *head[1:4], 1e-6, 1e-6)
    names = [name for name, _ in launches]
    assert names == ["_dsv4_hc_mixes_kernel", "_dsv4_hc_pre_kernel"] * 3
    assert [grid for name, grid in launches if name == "_dsv4_hc_pre_kernel"] == [(3, 2), (3, 2), (3, 1)]
    assert set(counter.ops) <= {"aten.empty", "aten.empty_like"}, counter.ops


def test_finish_in_one_program_a_token(monkeypatch):
    """SPLIT_ROLES off (the benchmark's baseline): one finish program a token does the Sinkhorn, then u (and the
    norm): the same results as the side-by-side programs."""
    streams, fn, scale, base, _ = _layer(5, 3, 128, seed=9)
    split = dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, None, 1e-5)
    plain = dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    monkeypatch.setattr(kernels, "SPLIT_ROLES", False)
    for a, b in zip(dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, None, 1e-5), split):
        assert torch.equal(a.float(), b.float())
    for a, b in zip(dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6), plain):
        assert torch.equal(a, b)


def test_layer_pre_norm_paths(monkeypatch):
    """mhc.hc_pre_norm: on CPU hc_pre then the norm, exactly (the quantized input from RMSNorm.forward_fp8); where
    the kernels run (here interpreted) the folded launches, the FP8 path an Fp8Activation of its codes."""
    from sglang.srt.layers.norm import RMSNorm
    from sglang.srt.layers.quantization.fp8 import Fp8Activation

    streams, fn, scale, base, _ = _layer(4, 4, 128, seed=6)
    norm = RMSNorm(128, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(128, generator=torch.Generator().manual_seed(2)))
    y, x_in, post, comb = mhc.hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, norm, None)
    u, want_post, want_comb = hc_pre_ref(streams, fn, scale, base, 20, 1e-6, 1e-6)
    assert x_in is y and torch.equal(y, norm(u)) and torch.equal(post, want_post) and torch.equal(comb, want_comb)
    monkeypatch.setattr(mhc, "_fused", lambda name, x: getattr(kernels, name))
    y, x_in, post, comb = mhc.hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, norm, None)
    assert x_in is y
    assert torch.equal(y, dsv4_hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, norm.weight, 1e-5)[0])
    monkeypatch.setattr(mhc, "sgl_kernel_op", lambda module, name: getattr(kernels, name))
    y8, x_in, post8, _ = mhc.hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, norm, "w8a8")
    want = dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, norm.weight, 1e-5)
    assert isinstance(x_in, Fp8Activation) and x_in.path == "w8a8" and x_in.rows == 4 and x_in.dtype == y8.dtype
    assert torch.equal(y8, want[0]) and torch.equal(x_in.q.float(), want[3].float()) and torch.equal(x_in.scale,
                                                                                                      want[4])
    assert torch.equal(post8, post)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
def test_gpu_mix_flash_rows():
    _compare(4096, 4, 20, seed=1, device="cuda", atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 8, 32, 128])
def test_gpu_flash_widths_dispatch_and_graph(t):
    """n 4, D 4096, bf16 streams: each kernel against the fp32 torch path (half a bf16 ulp: rounding to nearest);
    the layer's hc_pre / hc_post / hc_head are the kernels on CUDA; pre -> post -> head captured as a CUDA graph and
    replayed with new streams and sub-layer outputs equals the same chain launched plainly, bit for bit."""
    from graph_replays import assert_replays_equal

    streams, fn, scale, base, out = _layer(t, 4, 4096, seed=t, dtype=torch.bfloat16, device="cuda")
    head = _layer(t, 4, 4096, seed=t + 1, device="cuda", head=True)[1:4]
    u, post, comb = _check_pre(streams, fn, scale, base, gpu=True)
    new = _check_post(out, streams, post, comb, gpu=True)
    _check_head(new, *head, gpu=True)
    for name, op in (("dsv4_hc_pre", dsv4_hc_pre), ("dsv4_hc_post", dsv4_hc_post), ("dsv4_hc_head", dsv4_hc_head)):
        assert mhc._fused(name, streams) is op
    layer_u, layer_post, layer_comb = mhc.hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    assert torch.equal(layer_u, u) and torch.equal(layer_post, post) and torch.equal(layer_comb, comb)
    assert torch.equal(mhc.hc_post(out, streams, post, comb), new)
    assert torch.equal(mhc.hc_head(new, *head, 1e-6, 1e-6), dsv4_hc_head(new, *head, 1e-6, 1e-6))

    live = (streams.clone(), out.clone())

    def chain():
        u, post, comb = dsv4_hc_pre(live[0], fn, scale, base, 20, 1e-6, 1e-6)
        new = dsv4_hc_post(live[1] + u, live[0], post, comb)  # o depends on u, as a sub-layer's does
        return torch.cat((new.flatten(), dsv4_hc_head(new, *head, 1e-6, 1e-6).flatten(), post.flatten().bfloat16()))

    assert_replays_equal(chain, chain, live, lambda seed: _layer(t, 4, 4096, seed=seed, dtype=torch.bfloat16,
                                                                  device="cuda")[::4], seeds=(100, 101))


_RESOURCES = r"""  # after sm90_compile.SM90_PREAMBLE
import sys
import sgl_kernel.dsv4_mhc as k

def stack(kernel, types, consts, warps):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n.endswith("_ptr")}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]
    return list(usage(cubin))

out = {}
for t, split in [(int(a), False) for a in sys.argv[1:]] + [(int(a), True) for a in sys.argv[1:] if int(a) > 16]:
    launch = k.mixes_launch(t, 4096, split=split)
    out[f"mixes {t}{' split' if split else ''}"] = stack(
        k._dsv4_hc_mixes_kernel, {"s_ptr": "*bf16", "fn_ptr": "*fp32", "part_ptr": "*fp32"},
        dict(N=4, W=32, BLOCK_T=launch.block_t, BLOCK_D=launch.block_d, D_TILES=launch.d_tiles, SPLIT=split, MMA=True,
             PDL=True), launch.num_warps)
fp32 = {"width": "fp32", "norm_eps": "fp32", "eps": "fp32", "rms_eps": "fp32", "s_ptr": "*bf16", "u_ptr": "*bf16",
        "o_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv"}
fp32.update({n: "*fp32" for n in ("part_ptr", "scale_ptr", "base_ptr", "post_ptr", "comb_ptr", "qs_ptr")})
finish = dict(N=4, NP=4, W=32, BLOCK_C=32, MIX=True, HAS_WEIGHT=True, FP8_MAX=448.0, ROUND_IN_FP32=False, ROLES=2,
              PDL=True)
out["pre"] = stack(k._dsv4_hc_pre_kernel, fp32, dict(finish, BLOCK_D=k.U_BLOCK_D, NORM=False, QUANT=False),
                   k.finish_warps(k.U_BLOCK_D, 4, False))
for name, quant in (("pre_norm", False), ("pre_norm_fp8", True)):
    out[name] = stack(k._dsv4_hc_pre_kernel, fp32, dict(finish, BLOCK_D=4096, NORM=True, QUANT=quant),
                      k.finish_warps(4096, 4, True))
out["post"] = stack(k._dsv4_hc_post_kernel, fp32, dict(N=4, NP=4, BLOCK_D=k.POST_BLOCK_D, PDL=True), 4)
print(json.dumps(out))
"""


def test_sm90_launches_do_not_spill():
    """Compiled for sm90 on the CPU at Flash's widths (bf16 streams) as the engine launches them, and the mixes as
    bf16 MMAs (SPLIT) past 16 rows: no kernel keeps a local-memory stack (spills). The mixes' fp32 dot runs on FMAs;
    at 64-token blocks it spills on 4 warps; the MMAs spill with 64-column tiles."""
    from sm90_compile import SM90_PREAMBLE, compiled_facts

    found = compiled_facts(SM90_PREAMBLE + _RESOURCES, "1", "32", "128", "8192", timeout=600)
    print(found)  # [registers, stack bytes] per kernel
    assert all(regs <= 255 and stack == 0 for regs, stack in found.values()), found


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 8, 32, 128])
def test_gpu_pre_norm_flash_widths_and_graph(t):
    """n 4, D 4,096, bf16: hc_pre_norm within a bf16 rounding (and the sums of squares' order) of the norm of
    dsv4_hc_pre's u, post and comb exactly dsv4_hc_pre's; the FP8 variant's codes and multipliers those of
    dsv4_fp8_act_quant of its own row; captured as a CUDA graph and replayed with new streams, equal to plain launches
    bit for bit."""
    from graph_replays import assert_replays_equal
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant

    streams, fn, scale, base, _ = _layer(t, 4, 4096, seed=t + 3, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(4096, generator=torch.Generator().manual_seed(t)).bfloat16().cuda()
    u, post, comb = dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    y, y_post, y_comb = dsv4_hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)
    assert torch.equal(y_post, post) and torch.equal(y_comb, comb)
    torch.testing.assert_close(y.float(), _norm_ref(u.float(), weight, 1e-5), rtol=BF16_ULP, atol=1e-5)
    for cublas_layout in (False, True):
        y8, _, _, q, qs = dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5, cublas_layout)
        torch.testing.assert_close(y8, y, rtol=BF16_ULP, atol=1e-5)
        q_ref, qs_ref = dsv4_fp8_act_quant(y8, cublas_layout=cublas_layout)
        assert torch.equal(q.float(), q_ref.float()) and torch.equal(qs, qs_ref)

    live = (streams.clone(),)

    def chain():
        y, post, comb, q, qs = dsv4_hc_pre_norm_fp8(live[0], fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)
        y2 = dsv4_hc_pre_norm(live[0], fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)[0]
        return torch.cat((y.float().flatten(), y2.float().flatten(), post.flatten(), comb.flatten(),
                          q.float().flatten(), qs.flatten()))

    assert_replays_equal(chain, chain, live, lambda seed: _layer(t, 4, 4096, seed=seed, dtype=torch.bfloat16,
                                                                  device="cuda")[:1], seeds=(200, 201))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [128, 8192])
def test_gpu_blocked_finish_matches_per_token(monkeypatch, t):
    """Flash widths on a GPU: the finish's post and Sinkhorn comb in 64-token programs give a finish program a
    token's norm(u) and codes bit for bit, post and comb to fp32 summation order."""
    streams, fn, scale, base, _ = _layer(t, 4, 4096, seed=t + 7, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(4096, generator=torch.Generator().manual_seed(t)).bfloat16().cuda()
    monkeypatch.setattr(kernels, "FINISH_BLOCKED_MIN_ROWS", None)
    per_token = dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)
    monkeypatch.setattr(kernels, "FINISH_BLOCKED_MIN_ROWS", 16)
    blocked = dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, weight, 1e-5)
    for i in (0, 3, 4):
        assert torch.equal(blocked[i], per_token[i])
    torch.testing.assert_close(blocked[1], per_token[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blocked[2], per_token[2], rtol=1e-5, atol=1e-6)
