"""The checkpoint's formats kept on ROCm, on a CPU by simulating the platform: the FP8 encoding per target (e4m3fnuz
on gfx942, OCP e4m3fn elsewhere), the decisions (FP8 linears and MXFP4 experts kept on gfx942 / gfx950, not on
other AMD GPUs; no cuBLAS recipe and no scaled dot on gfx942), the load conversion of every e4m3fn code to fnuz, and
an FP8 linear and FP8 experts loaded from the hub-quantized tiny checkpoint under simulated gfx942 holding exactly
the e4m3fn weights' values."""

from __future__ import annotations

import logging

import pytest
import torch

from oracle import checkpoint
from sglang.srt import platform as plat
from sglang.srt.layers.quantization.fp8 import (
    Fp8BlockLinear, Fp8RoutedExperts, cublas_blockwise_ok, dequantize_weight, fp8_linears_supported,
    fp8_mma_supported)
from sglang.srt.layers.quantization.fp8_format import (
    E4M3FN, E4M3FNUZ, e4m3fn_to_fnuz, fp8_format, fp8_format_for, to_fp8_format)
from sglang.srt.layers.quantization.mxfp4 import mxfp4_experts_supported, scaled_dot_supported

CUDA = torch.device("cuda")  # ROCm's torch names its GPUs cuda too; nothing is allocated on it here


def test_format_per_target():
    assert fp8_format_for("gfx942") == fp8_format_for("gfx942:sramecc+:xnack-") == E4M3FNUZ
    for target in ("gfx950", "sm90", "sm100", "cuda", "cpu", None):
        assert fp8_format_for(target) == E4M3FN
    assert (E4M3FN.dtype, E4M3FN.max, E4M3FN.checkpoint_rescale, E4M3FN.triton_dtype) == \
        (torch.float8_e4m3fn, 448.0, False, "fp8e4nv")
    assert (E4M3FNUZ.dtype, E4M3FNUZ.max, E4M3FNUZ.checkpoint_rescale, E4M3FNUZ.triton_dtype) == \
        (torch.float8_e4m3fnuz, 240.0, True, "fp8e4b8")
    assert E4M3FNUZ.max == torch.finfo(torch.float8_e4m3fnuz).max and E4M3FN.max == torch.finfo(E4M3FN.dtype).max
    assert fp8_format() == E4M3FN  # this CPU
    with plat.simulate_platform("hip", gfx="gfx942"):
        assert fp8_format() == E4M3FNUZ
    for gfx in ("gfx950", "gfx90a"):
        with plat.simulate_platform("hip", gfx=gfx):
            assert fp8_format() == E4M3FN
    with plat.simulate_platform("cuda"):
        assert fp8_format() == E4M3FN


def test_kept_formats_per_platform(caplog, monkeypatch):
    from sglang.srt.layers.quantization import fp8_format as fmt

    monkeypatch.setattr(fmt, "_LOGGED", set())  # the once-per-architecture line, as at start
    caplog.set_level(logging.INFO, logger="sglang.srt.layers.quantization.fp8_format")
    for supported in (fp8_linears_supported, mxfp4_experts_supported):
        assert not supported(torch.device("cpu"))
        for kind, gfx in (("cuda", None), ("hip", "gfx942"), ("hip", "gfx950")):
            with plat.simulate_platform(kind, gfx=gfx):
                assert supported(CUDA) and not supported(torch.device("cpu"))
        with plat.simulate_platform("hip", gfx="gfx90a"):  # MI250: no FP8 MFMA
            assert not supported(CUDA)
    assert "ROCm gfx90a: the checkpoint's FP8 / MXFP4 weights are dequantized at load" in caplog.text
    assert caplog.text.count("gfx90a") == 1  # logged once per architecture


def test_rocm_paths():
    """FP8 MMA from the architecture (not the capability ROCm's torch reports); no cuBLAS blockwise recipe on ROCm
    (decided before any probe); tl.dot_scaled for the MXFP4 MoE on gfx950 and NVIDIA GPUs, not on gfx942."""
    for gfx, mma, scaled in (("gfx942", True, False), ("gfx950", True, True), ("gfx90a", False, False)):
        with plat.simulate_platform("hip", gfx=gfx):
            assert fp8_mma_supported(CUDA) == mma and scaled_dot_supported() == (scaled and gfx != "gfx90a")
            assert not cublas_blockwise_ok(CUDA, 4096, 4096)  # would probe torch._scaled_mm on a GPU elsewhere
    with plat.simulate_platform("cuda"):
        assert scaled_dot_supported()


def test_every_e4m3fn_code_converts_to_the_same_value():
    """dequant(e4m3fn code, s) == dequant(fnuz code, 2 s) for all 256 codes (NaN for NaN); -0 becomes +0 (0x80 is
    fnuz's NaN); every other finite code keeps its byte."""
    codes = torch.arange(256, dtype=torch.uint8)
    for s in (1.0, 2.0 ** -9, 2.0 ** 7):
        scale = torch.full((1,), s)
        w, scale2 = e4m3fn_to_fnuz(codes.view(torch.float8_e4m3fn), scale)
        assert w.dtype == torch.float8_e4m3fnuz and torch.equal(scale2, scale * 2)
        before = codes.view(torch.float8_e4m3fn).float() * scale
        after = w.float() * scale2
        assert torch.equal(before.isnan(), after.isnan()) and before.isnan().sum() == 2
        ok = ~before.isnan()
        assert torch.equal(before[ok], after[ok]) and not torch.signbit(after[0x80])
    b = w.view(torch.uint8)
    assert b[0x80] == 0 and b[0x7F] == b[0xFF] == 0x80
    finite = (codes != 0x80) & ((codes & 0x7F) != 0x7F)
    assert torch.equal(b[finite], codes[finite])
    same_w, same_s = to_fp8_format(codes.view(torch.float8_e4m3fn), scale, E4M3FN)  # gfx950 / NVIDIA: as stored
    assert same_w.dtype == torch.float8_e4m3fn and torch.equal(same_w.view(torch.uint8), codes) and same_s is scale


def _kept(path, config):
    from sglang.srt.model_loader.loader import iter_checkpoint

    return dict(iter_checkpoint(path, config, keep_fp8=frozenset({"layers.1.attn.wq_a.weight"}),
                                select=lambda n: n.startswith("layers.1.attn.wq_a.")))


def test_fp8_linear_loaded_under_gfx942_holds_the_checkpoint_values():
    from sglang.srt.model_loader.loader import load_config

    path = checkpoint("tiny", quantize=True)
    config = load_config(path)
    name = "layers.1.attn.wq_a"
    stored = _kept(path, config)  # this CPU: e4m3fn as stored
    with plat.simulate_platform("hip", gfx="gfx942"):
        loaded = _kept(path, config)  # the platform's encoding by default
        linear = Fp8BlockLinear(config.hidden_size, config.q_lora_rank)
    w, s = stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and linear.weight.dtype == loaded[f"{name}.weight"].dtype == \
        torch.float8_e4m3fnuz
    linear.weight.data.copy_(loaded[f"{name}.weight"])
    linear.weight_scale_inv.data.copy_(loaded[f"{name}.weight_scale_inv"])
    assert torch.equal(linear.weight_scale_inv, s * 2)
    assert torch.equal(dequantize_weight(linear.weight, linear.weight_scale_inv, torch.float32),
                       dequantize_weight(w, s, torch.float32))
    assert "e4m3fnuz" in repr(linear)


def test_fp8_experts_under_gfx942():
    """FP8-converted experts get the same conversion: built fnuz under gfx942, loaded bytes halved in value and
    multipliers doubled."""
    fmt = E4M3FNUZ
    with plat.simulate_platform("hip", gfx="gfx942"):
        experts = Fp8RoutedExperts(2, 256, 128, 10.0)
    assert experts.w13.dtype == experts.w2.dtype == fmt.dtype
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(128, 256, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s1 = torch.ldexp(torch.ones(1, 2), torch.randint(-10, -4, (1, 2), generator=g))
    fw, fs = to_fp8_format(w1, s1, fmt)
    experts.load_expert("w1", 1, fw, False)
    experts.load_expert("w1", 1, fs, True)
    assert torch.equal(dequantize_weight(experts.w13[1, :128], experts.w13_scale[1, 0], torch.float32),
                       dequantize_weight(w1, s1, torch.float32))


def test_mxfp4_experts_pick_the_dequantizing_path_on_gfx942(monkeypatch):
    import sgl_kernel.dsv4_moe as moe

    from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts

    seen = []
    monkeypatch.setattr(moe, "dsv4_moe_mxfp4", lambda *a, **kw: seen.append(kw["scaled_dot"]))
    experts = Mxfp4RoutedExperts(2, 64, 64, 10.0)
    x, ids, weights = torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    for gfx in ("gfx942", "gfx950"):
        with plat.simulate_platform("hip", gfx=gfx):
            experts(x, ids, weights)
    assert seen == [False, True]


@pytest.mark.parametrize("scaled_dot,words", [(True, "tl.dot_scaled"), (False, "in-register dequantization")])
def test_mxfp4_log_line_names_the_general_path(scaled_dot, words):
    from sgl_kernel.dsv4_moe import describe_mxfp4

    line = describe_mxfp4(torch.device("cpu"), torch.bfloat16, 64, 64, 10.0, scaled_dot=scaled_dot)
    assert f"general kernels ({words}) at every batch size" == line
