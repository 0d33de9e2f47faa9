"""The FP8 kernels in gfx942's encoding, float8_e4m3fnuz (largest 240, exponent bias 8, no -0), under the Triton
interpreter (which converts fnuz as it converts e4m3fn) against the torch references: the activation scale's exponent
for 240, the activation codes bit for bit (ties to even, the fnuz subnormal spacing 2^-10, no 0x80), the W8A8 GEMM on
an fnuz weight quantizing its activations to fnuz, and a producer (the RMSNorm) writing fnuz codes."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant, dsv4_fp8_block_gemm
from sgl_kernel.dsv4_fp8_gemm_ref import act_quant_ref, act_scale_exponent, fp8_block_linear_ref, fp8_max

FNUZ = torch.float8_e4m3fnuz


def test_fp8_max_per_dtype():
    assert fp8_max(torch.float8_e4m3fn) == 448.0 and fp8_max(FNUZ) == 240.0
    with pytest.raises(ValueError, match="e4m3"):
        fp8_max(torch.float8_e5m2)


def test_scale_exponent_for_240():
    amax = torch.tensor([240.0, 240.5, 480.0, 1.0, 0.0, 1e-45, 1.875, 1.9, 3.5 * 2 ** 100])
    e = act_scale_exponent(amax, 240.0)
    assert e.tolist() == [0, 1, 1, -7, -126, -126, -7, -6, 94]
    ok = amax / torch.ldexp(torch.ones(9), e) <= 240  # the smallest such e: one less overflows (where allowed)
    tighter = amax / torch.ldexp(torch.ones(9), e - 1) > 240
    assert ok.all() and tighter[:4].all() and tighter[6:].all()


@pytest.mark.parametrize("groups,k", [(1, 256), (2, 200)])
def test_act_quant_fnuz_matches_reference(groups, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(6, groups * k, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0  # a zero row
    x[4, :64] = -1e-30  # negatives that round to zero: +0 (0x00), never fnuz's NaN 0x80
    x[5, 1] = x[5].abs().max() * 2 ** -11  # a subnormal code
    q, s = dsv4_fp8_act_quant(x, groups, dtype=FNUZ)
    assert q.dtype == FNUZ
    ref_q, ref_s = zip(*(act_quant_ref(x[:, i * k:(i + 1) * k], dtype=FNUZ) for i in range(groups)))
    assert torch.equal(s, torch.cat(ref_s, dim=1))
    assert torch.equal(q.view(torch.uint8), torch.cat(ref_q, dim=1).view(torch.uint8))
    assert not (q.view(torch.uint8) == 0x80).any() and not q.float().isnan().any()
    assert 120 < q.float().abs().max() <= 240  # power-of-two scales: a block's largest code in (120, 240]


def test_w8a8_on_an_fnuz_weight():
    """The GEMM quantizes its activations to the weight's encoding (the FP8 MMA takes one kind): fnuz weights give
    fnuz activations, and the result is the fp32 product of both dequantized."""
    g = torch.Generator().manual_seed(0)
    n, k = 96, 384
    w = (torch.randn(n, k, generator=g) * 60).clamp(-240, 240).to(FNUZ)
    ws = torch.ldexp(torch.ones(1, 3), torch.randint(-12, -4, (1, 3), generator=g))
    x = torch.randn(5, k, generator=g)
    got = dsv4_fp8_block_gemm(x, w, ws, out_dtype=torch.float32)
    ref = fp8_block_linear_ref(x, w, ws)  # x quantized to fnuz, then the fp32 product
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    e4m3fn = fp8_block_linear_ref(x, w.float().to(torch.float8_e4m3fn), ws)  # the same weight values, e4m3fn codes
    assert not torch.equal(ref, e4m3fn)  # the activations' encoding shows: fnuz rounding differs from e4m3fn's


def test_rms_norm_writes_fnuz_codes():
    from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm, dsv4_rms_norm_fp8

    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)) * 3
    w = torch.randn(256, generator=torch.Generator().manual_seed(2))
    y, q, s = dsv4_rms_norm_fp8(x, w, 1e-6, fp8_dtype=FNUZ)
    rq, rs = dsv4_fp8_act_quant(dsv4_rms_norm(x, w, 1e-6), dtype=FNUZ)
    assert q.dtype == FNUZ and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
