"""dsv4_moe_w4a8 (the fused MXFP4 MoE with FP8 activations, DeepSeek's reference function) against its torch
reference (dsv4_moe_mxfp4_ref.fused_moe_mxfp4_ref(fp8_acts=True)): the e4m3 bytes of every code byte (the Triton ops
and the inline PTX's arithmetic, read from its text), the activations' quantization and storage order, the whole op
at every launch tier (K splits, the unsplit gate-up's own quantization, prefill blocks, another rank's experts) on
the CPU interpreter; compiled for sm90 on the CPU: FP8 wgmma, no byte permutes, no spills at the decode launches;
GPU (sm90, skipped elsewhere): Flash widths against the reference, deterministic; the PDL chain bit-equal to plain
launches, eager and in CUDA-graph replays with new inputs."""

from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant
from sgl_kernel.dsv4_fp8_gemm_ref import act_quant_ref
from sgl_kernel.dsv4_formats_ref import e2m1_values
from sgl_kernel.dsv4_moe_mxfp4 import MoeConfig, MoeLaunch
from sgl_kernel.dsv4_moe_mxfp4_ref import fused_moe_mxfp4_ref
from sgl_kernel.dsv4_moe_w4a8 import (
    A8_DOWN, A8_DOWN_FEW, A8_DOWN_ONE, A8_GATE_UP, A8_GATE_UP_FEW, A8_GATE_UP_ONE, A8_PREFILL, a8_config,
    dsv4_moe_mxfp4_w4a8)
from sgl_kernel.dsv4_mxfp4_e4m3 import _PTX, fp4_group_e4m3, parity_order

from ptx_text import run_ptx
from test_dsv4_moe_mxfp4 import _experts, _routing

E2M1 = e2m1_values(torch.arange(16)).tolist()  # signed values of the 16 codes


def _value(code: int) -> float:
    return E2M1[code]


@triton.jit
def _convert_kernel(b_ptr, out_ptr):
    r = tl.arange(0, 16)
    b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
    tl.store(out_ptr + r[:, None] * 32 + tl.arange(0, 32)[None, :], fp4_group_e4m3(b, False).to(tl.float32))


def test_every_code_byte_converts_to_its_e4m3_values_in_group_parity_order():
    """All 256 code bytes as 16 rows of one scale group: row i's 32 inputs come out as the 16 even inputs (low
    nibbles), then the 16 odd ones, each the code's value * 2^-6."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    out = torch.empty(16, 32)
    _convert_kernel[(1,)](b, out)
    want = torch.tensor([[_value(v & 15) for v in row] + [_value(v >> 4) for v in row] for row in b.tolist()])
    assert torch.equal(out, want * 2.0 ** -6)


def test_ptx_computes_the_same_bytes():
    """The inline PTX (GPUs), executed from its own text on 4 code bytes at a time: every byte value in every byte
    position gives the bytes the Triton ops give (e4m3 of the low nibble in $0, of the high nibble in $1)."""
    def e4m3(code):
        return ((code & 7) << 2) | ((code & 8) << 4)

    for v in range(256):
        for pos in range(4):
            word = (v << (8 * pos)) | (0xA5 << (8 * ((pos + 1) % 4)))  # a neighbour byte: no bleeding across
            regs = run_ptx(_PTX.value, {"$2": word})
            lo, hi = regs["$0"], regs["$1"]
            for p, byte in ((pos, v), ((pos + 1) % 4, 0xA5)):
                assert (lo >> (8 * p)) & 0xFF == e4m3(byte & 15), (v, pos)
                assert (hi >> (8 * p)) & 0xFF == e4m3(byte >> 4), (v, pos)


def test_quantized_activations_in_group_parity_order():
    """dsv4_fp8_act_quant(parity=True)'s e4m3 rows are act_quant_ref's (per token and 128 inputs, power-of-two
    scales) stored in group parity order, its multipliers the reference's."""
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 512)
    q, s = dsv4_fp8_act_quant(x, parity=True)
    ref_q, ref_s = act_quant_ref(x)
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)[:, parity_order(512)])


E, D, I, K = 8, 512, 256, 2

_TIERS = {
    "one": MoeConfig(16, A8_GATE_UP_ONE, A8_DOWN_ONE),  # K splits in both (SwiGLU + quantization over the splits)
    "few": MoeConfig(16, A8_GATE_UP_FEW, A8_DOWN_FEW),
    "decode": MoeConfig(16, A8_GATE_UP, A8_DOWN),
    "unsplit": MoeConfig(16, MoeLaunch(128, 128, 4, 3, scaled_dot=False), A8_DOWN),  # quantizes its own 128 columns
    "prefill": MoeConfig(64, A8_PREFILL, A8_PREFILL),
    "auto": None,
}


@pytest.mark.parametrize("tier,tokens,foreign", [
    ("one", 1, False), ("few", 3, False), ("decode", 6, False), ("prefill", 40, False), ("auto", 70, False),
    ("decode", 9, True)])
def test_w4a8_equals_reference(tier, tokens, foreign):
    """The whole op against DeepSeek's function (FP8 activations), and visibly not the W4A16 function: its error
    against the W4A8 reference is far below the two references' difference. `foreign`: another rank's experts
    (id -1) add nothing."""
    w13, s13, w2, s2 = _experts(E, D, I, seed=1)
    ids, weights = _routing(tokens, K, E, seed=tokens, skew=False)
    if foreign:
        ids = torch.where(ids >= E // 2, -1, ids)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(2)) * 0.5
    got = dsv4_moe_mxfp4_w4a8(x, ids, weights, w13, s13, w2, s2, 10.0, config=_TIERS[tier]).float()
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0, fp8_acts=True)
    w4a16 = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= 2e-3 * scale, (err, scale)  # fp32 sums in another order; a rare e4m3 tie in h may round apart
    assert (w4a16 - ref).abs().max().item() > 20 * max(err, 1e-6 * scale)


@pytest.mark.parametrize("hip,capability,expected", [(None, (9, 0), True), (None, (10, 0), True),
                                                      (None, (8, 9), False), ("6.2", (9, 4), False)])
def test_a8_gate_simulated_platforms(monkeypatch, hip, capability, expected):
    """W4A8 needs an NVIDIA sm90+ GPU (FP8 wgmma); ROCm and older GPUs are refused (they keep W4A16), the CPU
    interpreter runs it for tests."""
    from sgl_kernel.dsv4_moe_w4a8 import a8_supported

    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert a8_supported(torch.device("cuda", 0)) is expected
    assert a8_supported(torch.device("cpu"))


def test_auto_tiers_and_width_check():
    assert a8_config(6, 256).gate_up.split_k == 4 and a8_config(30, 256).gate_up.split_k == 4
    assert a8_config(48, 256).gate_up.split_k == 2 and a8_config(48, 256).down.block_n == 128
    assert a8_config(192, 256).block_m == 16 and a8_config(24576, 256).block_m == 64
    x = torch.zeros(1, 96)
    w13, s13, w2, s2 = _experts(2, 96, 64, seed=0)
    with pytest.raises(ValueError, match="multiples of 256"):
        dsv4_moe_mxfp4_w4a8(x, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), w13, s13, w2, s2, 10.0)


_SASS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from moe_registers import compile_a8, loop_mix, resources
from sgl_kernel.dsv4_moe_w4a8 import a8_config
out = []
for tokens in (1, 4, 8, 32):
    cfg = a8_config(tokens * 6, 256)
    for name, launch in (("gate_up", cfg.gate_up), ("down", cfg.down)):
        c = compile_a8(name, launch, cfg.block_m)
        out.append([tokens, name, resources(c), loop_mix(c, top=40)])
print(json.dumps(out))
"""


def test_decode_launches_compile_to_fp8_wgmma_without_byte_permutes():
    """Compiled for sm90 on the CPU: every decode launch's K loop runs FP8 wgmma (QGMMA), converts the codes without
    byte permutes (the group parity order lines them up with the activations), moves the scales into the
    accumulator's layout with few barriers and touches no local memory."""
    import os

    from sm90_compile import compiled_facts

    tools = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmark", "kernels")
    found = compiled_facts(_SASS, tools)
    assert len(found) == 8
    for tokens, name, res, mix in found:
        counts = {op: int(n) for op, n in re.findall(r"([A-Z0-9_]+) (\d+)", mix)}
        assert "LDL" not in counts and "STL" not in counts, (tokens, name, res, mix)  # Triton 3.6: no stack at all
        # Triton 3.9 leaves a few PRMTs outside the conversion (8 per K step); codes joined in input order cost ~9
        # per 4 code bytes (~290 per K step of the 1-token gate-up)
        assert counts.get("QGMMA", 0) > 0 and "HMMA" not in counts and counts.get("PRMT", 0) <= 16, (tokens, name,
                                                                                                       mix)
        # the scale bytes reach the accumulator's rows one 4-byte word per 4 groups: ~2 barriers per conversion, 2-3
        # conversions per 128 inputs (one byte per group took 8 conversions and 16 barriers)
        assert counts.get("BAR", 0) <= 8, (tokens, name, mix)


needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0)
                                or torch.version.hip is not None, reason="needs an NVIDIA sm90+ GPU")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tokens", [1, 4, 8, 32, 300])
def test_gpu_flash_widths_equal_reference(tokens):
    """Flash widths (256 experts, top-6, hidden 4,096, intermediate 2,048), bf16 activations, the launches
    a8_config picks (PDL chain, inline PTX): against the reference on the touched experts; two runs bit-equal."""
    e, d, i, k = 256, 4096, 2048, 6
    w13, s13, w2, s2 = _experts(e, d, i, seed=5, device="cuda")
    ids, weights = _routing(tokens, k, e, seed=tokens, skew=False, device="cuda")
    x = (torch.randn(tokens, d, generator=torch.Generator().manual_seed(3)) * 0.5).to("cuda", torch.bfloat16)
    got = dsv4_moe_mxfp4_w4a8(x, ids, weights, w13, s13, w2, s2, 10.0)
    again = dsv4_moe_mxfp4_w4a8(x, ids, weights, w13, s13, w2, s2, 10.0)
    ref = fused_moe_mxfp4_ref(x.float(), ids, weights, w13, s13, w2, s2, 10.0, fp8_acts=True)
    assert torch.equal(got, again)
    err = (got.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), err  # bf16 output rounding (2^-9) and rare e4m3 ties in h


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tokens", [1, 4, 8, 32])  # a8_config's decode tiers
def test_gpu_pdl_chain_bit_equal_in_graph_replays(tokens):
    """The W4A8 decode chain (align, quantization, gate-up, SwiGLU over splits, down, combine) as PDL launches, eager
    and replayed from a CUDA graph with new activations, routes and weights before each replay, equals the launches
    without PDL bit for bit."""
    import dataclasses

    e, d, i, k = 256, 4096, 2048, 6
    w13, s13, w2, s2 = _experts(e, d, i, seed=0, device="cuda")
    cfg = a8_config(tokens * k, e)
    plain = dataclasses.replace(cfg, pdl=False)

    def inputs(seed):
        ids, weights = _routing(tokens, k, e, seed=seed, skew=False, device="cuda")
        x = (torch.randn(tokens, d, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
             * 0.5).bfloat16()
        return x, ids, weights

    from graph_replays import assert_replays_equal

    x, ids, weights = inputs(1)
    run = lambda c: dsv4_moe_mxfp4_w4a8(x, ids, weights, w13, s13, w2, s2, 10.0, config=c)  # noqa: E731
    assert torch.equal(run(cfg), run(plain))
    assert_replays_equal(lambda: run(cfg), lambda: run(plain), (x, ids, weights), inputs, range(2, 6))
