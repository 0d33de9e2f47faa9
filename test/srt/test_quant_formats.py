"""E8M0, FP8 block and MXFP4 helpers: round trips, exact dequantization, nibble order, scale rules."""

from __future__ import annotations

import math

import pytest
import torch

from sglang.srt.model_loader.quant_formats import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    e8m0_encode,
    e8m0_from_exponent,
    e8m0_to_exponent,
    e8m0_to_float,
    quantize_fp8_block,
    quantize_mxfp4,
)

FP4_MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e8m0_bytes(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def _fp4_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Independent float64 decode: per-element table lookup, low nibble = even input index."""
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.empty(b.shape[0], b.shape[1] * 2, dtype=torch.int64)
    codes[:, 0::2], codes[:, 1::2] = b & 15, b >> 4
    mags = torch.tensor(FP4_MAGS, dtype=torch.float64)[codes & 7]
    vals = torch.where(codes & 8 > 0, -mags, mags)
    exps = scale.view(torch.uint8).to(torch.float64) - 127
    return vals * torch.pow(2.0, exps).repeat_interleave(32, dim=1)


# ---- E8M0 ---------------------------------------------------------------------------------------
def test_e8m0_decode_every_byte_exactly():
    scale = _e8m0_bytes(list(range(256)))
    got = e8m0_to_float(scale)
    want = torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float64).float()
    assert torch.equal(got[:255], want)
    assert math.isnan(got[255].item())
    assert got[127].item() == 1.0 and got[0].item() == 2.0 ** -127 and got[254].item() == 2.0 ** 127


def test_e8m0_encode_round_trip_and_rejects_non_powers():
    exps = torch.arange(-127, 128)
    x = torch.pow(2.0, exps.double()).float()
    enc = e8m0_encode(x)
    assert enc.dtype == torch.float8_e8m0fnu
    assert torch.equal(enc.view(torch.uint8).long(), exps + 127)
    assert torch.equal(e8m0_to_float(enc), x)
    assert torch.equal(e8m0_to_exponent(e8m0_from_exponent(exps)), exps.int())
    with pytest.raises(ValueError):
        e8m0_encode(torch.tensor([3.0]))
    with pytest.raises(ValueError):
        e8m0_encode(torch.tensor([-2.0]))


# ---- FP8 e4m3 with 128x128 block scales ----------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 256), (200, 300), (96, 256), (1, 5)])
def test_fp8_block_shapes_scales_and_exact_dequant(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1])  # spread block magnitudes
    q, scale = quantize_fp8_block(w)
    ob, ib = math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (ob, ib)
    # Scale rule, per (partial) block, computed independently in float64.
    for i in range(ob):
        for j in range(ib):
            amax = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max().item()
            want = math.ceil(math.log2(max(amax, 1e-4) / 448))
            assert e8m0_to_exponent(scale)[i, j].item() == want
    assert q.float().abs().max().item() <= 448
    # Dequantization is the exact product e4m3 * 2^e (float64 reference, compared bit for bit).
    mult = torch.pow(2.0, e8m0_to_exponent(scale).double())
    mult = mult.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    want = (q.double() * mult).float()
    got = dequantize_fp8_block(q, scale, torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # Round trip: e4m3 keeps 3 mantissa bits, so the error is at most 2^-4 of each value's magnitude
    # (or half the smallest subnormal step of its block).
    err = (got - w).abs()
    assert bool((err <= w.abs() * 2.0 ** -4 + mult.float() * 2.0 ** -10).all())
    assert dequantize_fp8_block(q, scale, torch.bfloat16).dtype == torch.bfloat16


def test_fp8_clamps_before_cast_and_handles_zero_blocks():
    w = torch.zeros(128, 128)
    q, scale = quantize_fp8_block(w)
    assert e8m0_to_exponent(scale).item() == math.ceil(math.log2(1e-4 / 448))
    assert torch.equal(dequantize_fp8_block(q, scale), w)
    w[0, 0] = 448.0 * 2 ** 3  # exact power-of-two amax: scale 2^3, value maps to exactly 448
    q, scale = quantize_fp8_block(w)
    assert e8m0_to_exponent(scale).item() == 3 and q[0, 0].float().item() == 448.0


def test_fp8_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (128, 256), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    vals = codes.float().nan_to_num(0.0)
    vals[0, 0], vals[0, 128] = 448.0, -448.0  # pin amax so the scale is 2^0
    q, scale = quantize_fp8_block(vals * 2.0 ** -5)
    assert torch.equal(e8m0_to_exponent(scale), torch.full((1, 2), -5, dtype=torch.int32))
    assert torch.equal(dequantize_fp8_block(q, scale), vals * 2.0 ** -5)


# ---- MXFP4 ---------------------------------------------------------------------------------------
def test_mxfp4_nibble_order_and_sign_bit():
    # byte 0x21: low nibble code 1 (0.5) is input 0, high nibble code 2 (1.0) is input 1.
    # byte 0xF8: low code 8 (-0), high code 15 (-6).
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0], packed[0, 1] = 0x21, 0xF8
    scale = _e8m0_bytes([[128]])  # 2^1
    got = dequantize_mxfp4(packed.view(torch.int8), scale)
    assert got[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert torch.equal(got, dequantize_mxfp4(packed, scale))  # uint8 storage reads the same


def test_mxfp4_quantize_known_values_and_ties():
    row = torch.zeros(1, 64)
    row[0, :16] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1, -1.5, -2, -3, -4, -6, 0.0])
    # Ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; sign kept.
    row[0, 32:40] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])
    row[0, 40] = 6.0
    packed, scale = quantize_mxfp4(row * 4)  # amax 24 -> scale 2^2, codes reproduce the table
    assert packed.dtype == torch.int8 and packed.shape == (1, 32) and scale.shape == (1, 2)
    assert e8m0_to_exponent(scale).tolist() == [[2, 2]]
    got = dequantize_mxfp4(packed, scale) / 4
    assert torch.equal(got[0, :16], row[0, :16])
    assert got[0, 32:41].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0]
    assert packed.view(torch.uint8)[0, 0].item() == 0x10  # inputs 0 (code 0) and 1 (code 1)


def test_mxfp4_random_round_trip_scale_rule_and_exact_dequant():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 128, generator=g) * torch.logspace(-4, 1, 128)
    w[3, :32] = 0.0  # an all-zero block
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (24, 64) and scale.shape == (24, 4)
    exps = e8m0_to_exponent(scale)
    amax = w.view(24, 4, 32).abs().amax(-1)
    for (i, j), a in zip(torch.cartesian_prod(torch.arange(24), torch.arange(4)).tolist(), amax.flatten().tolist()):
        assert exps[i, j].item() == (math.ceil(math.log2(a / 6)) if a > 0 else -127)
    got = dequantize_mxfp4(packed, scale, torch.float32)
    want = _fp4_reference(packed, scale).float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # Nearest code: error at most half of the widest gap (2 at the top of the range) times the scale.
    step = torch.pow(2.0, exps.float()).repeat_interleave(32, 1)
    assert bool(((got - w).abs() <= step + 1e-30).all())
    assert torch.equal(got[3, :32], torch.zeros(32))
    assert dequantize_mxfp4(packed.view(torch.uint8), scale, torch.bfloat16).dtype == torch.bfloat16


def test_mxfp4_rejects_bad_shapes():
    with pytest.raises(ValueError, match="in % 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    packed, scale = quantize_mxfp4(torch.ones(4, 64))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_mxfp4(packed, scale[:, :1])
