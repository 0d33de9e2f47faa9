"""sgl_kernel.dsv4_target: the per-target answers the kernels' wrappers launch with (dot precision, tiles that fit the
target's LDS) and the one FP8 table, on this CPU. The wrappers are run under sgl_kernel.aot_check's recorder (the
sgl_kernel side of a simulated platform: it answers `hip_arch` for the target) in a process without the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sgl_kernel import dsv4_target
from sgl_kernel.aot_targets import TARGETS
from sgl_kernel.dsv4_fp8_gemm import Fp8GemmConfig, hip_config
from sgl_kernel.dsv4_moe import MoeLaunch, fit_shared_memory, hip_dequant_config, moe_config
from sglang.srt.layers.quantization.fp8_format import ROCM_FP8_ARCHS, fp8_format_for


def test_one_fp8_table_for_kernels_check_and_layers():
    for name in ("gfx942", "gfx950", "sm90", "sm100"):
        dtype = dsv4_target.fp8_dtype_for(name)
        assert fp8_format_for(name).dtype == TARGETS[name].fp8_dtype == dtype, name
    assert dsv4_target.fp8_dtype_for("gfx942:sramecc+:xnack-") == torch.float8_e4m3fnuz
    assert fp8_format_for("gfx942").dtype == torch.float8_e4m3fnuz and fp8_format_for(None).max == 448.0
    assert all(ROCM_FP8_ARCHS[a] == dsv4_target.fp8_dtype_for(a) for a in ROCM_FP8_ARCHS)


@pytest.mark.parametrize("arch, bf16, fp32", [(None, "tf32", "ieee"), ("gfx942", "tf32", "ieee"),
                                               ("gfx950", "ieee", "ieee")])
def test_dot_precision_per_target(monkeypatch, arch, bf16, fp32):
    monkeypatch.setattr(dsv4_target, "hip_arch", lambda device: arch)
    dev = torch.device("cpu")
    assert (dsv4_target.dot_precision(torch.bfloat16, dev), dsv4_target.dot_precision(torch.float32, dev)) == \
        (bf16, fp32)
    assert dsv4_target.lds_limit(dev) == {None: None, "gfx942": 65536, "gfx950": 163840}[arch]


def test_fp8_gemm_tiles_fit_the_lds():
    """gfx942: 64 x 64 bf16 W8A16 tiles at 4 stages (72 KiB there) drop to 3; fp32 tiles over the LDS halve N; gfx950
    keeps what fits; no TMA on ROCm."""
    four = Fp8GemmConfig(64, 64, 4, 4, tma=True)
    assert hip_config(four, 2, 64 * 1024) == Fp8GemmConfig(64, 64, 4, 3)
    assert hip_config(four, 2, 160 * 1024) == Fp8GemmConfig(64, 64, 4, 4)
    assert hip_config(Fp8GemmConfig(64, 128, 4, 2), 4, 40 * 1024).block_n == 64


def test_moe_dequant_tiles_on_rocm():
    nvidia = moe_config(8192 * 6, 256, scaled_dot=False, fp8=True)
    assert (nvidia.gate_up.block_n, nvidia.gate_up.block_k, nvidia.down.num_stages) == (64, 128, 3)
    for lds in (64 * 1024, 160 * 1024):
        for pairs in (6, 8192 * 6):
            cfg = moe_config(pairs, 256, scaled_dot=False, fp8=True, lds=lds)
            assert cfg == hip_dequant_config(cfg.block_m, lds)
            assert cfg.gate_up.num_stages == cfg.down.num_stages == 2
    assert moe_config(48, 256, lds=64 * 1024) == moe_config(48, 256)  # the scaled dot keeps its tiles


def test_moe_dequant_stages_fit_nvidia_shared_memory():
    """FP8 experts' decode gate-up with fp32 activations (256 KiB at its 3 stages) runs at 2 within an H100's 227 KiB;
    bf16 activations, the down, prefill tiles and the scaled dot keep theirs; no limit (CPU, ROCm) changes nothing."""
    h100 = 227 * 1024
    decode = moe_config(6, 256, scaled_dot=False, fp8=True)
    fp32 = fit_shared_memory(decode, 4, True, False, h100)
    assert fp32.gate_up == MoeLaunch(32, 256, 4, 2, scaled_dot=False) and fp32.down == decode.down
    assert fit_shared_memory(decode, 2, True, False, h100) == decode == fit_shared_memory(decode, 4, True, False, None)
    prefill = moe_config(8192 * 6, 256, scaled_dot=False, fp8=True)
    assert fit_shared_memory(prefill, 4, True, False, h100) == prefill
    assert fit_shared_memory(decode, 4, True, False, 64 * 1024).gate_up.num_stages == 1  # never below one stage
    scaled = moe_config(48, 256, tma=True)
    assert fit_shared_memory(scaled, 2, False, True, 1024) == scaled


def test_moe_dequant_stages_fit_sm100_shared_memory():
    """On sm100 FP8 experts' prefill gate-up with fp32 activations (272 KiB at its 2 stages there) runs at 1; every
    other launch keeps its stages (bf16 activations, the down, MXFP4 weights, decode); sm90 is unchanged."""
    limit = 227 * 1024
    prefill = moe_config(8192 * 6, 256, scaled_dot=False, fp8=True)
    sm100 = fit_shared_memory(prefill, 4, True, False, limit, arch=100)
    assert sm100.gate_up == MoeLaunch(64, 128, 4, 1, scaled_dot=False) and sm100.down == prefill.down
    assert fit_shared_memory(prefill, 4, True, False, limit, arch=90) == prefill
    assert fit_shared_memory(prefill, 2, True, False, limit, arch=100) == prefill
    mxfp4 = moe_config(8192 * 6, 256, scaled_dot=False)
    assert fit_shared_memory(mxfp4, 4, False, False, limit, arch=100) == mxfp4
    decode = moe_config(6, 256, scaled_dot=False, fp8=True)
    assert fit_shared_memory(decode, 4, True, False, limit, arch=100) == fit_shared_memory(decode, 4, True, False,
                                                                                            limit, arch=90)


RECORD = r"""
import json, torch
from sgl_kernel import aot_check
from sgl_kernel.aot_targets import TARGETS
from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_block_gemm
from sgl_kernel.dsv4_index_logits import dsv4_index_logits
from sgl_kernel.dsv4_moe import dsv4_moe_fp8
e = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
ids = lambda r, c, h: torch.randint(0, h, (r, c), device="meta")
out = {}
for name in ("gfx942", "gfx950", "sm90"):
    fp8 = TARGETS[name].fp8_dtype
    with aot_check.recording(TARGETS[name]) as rec:
        dsv4_fp8_block_gemm(e(32, 4096), e(1024, 4096, dtype=fp8), e(8, 32, dtype=torch.float32), quantize_act=False)
        dsv4_moe_fp8(e(1000, 4096), ids(1000, 6, 256), e(1000, 6, dtype=torch.float32), e(256, 4096, 4096, dtype=fp8),
                     e(256, 2, 16, 32, dtype=torch.float32), e(256, 4096, 2048, dtype=fp8),
                     e(256, 1, 32, 16, dtype=torch.float32), 10.0)
        rows = torch.zeros(512, dtype=torch.int64, device="meta")
        dsv4_index_logits(e(512, 64, 128), e(512, 64, dtype=torch.float32), e(4096, 132, dtype=torch.uint8),
                          "fp8_index", ids(128, 2048, 4096), rows, rows, e(512, 2048, dtype=torch.float32))
    out[name] = {l.name: {**{k: v for k, v in l.constexpr_names().items() if k in ("PREC", "DOT_PRECISION",
                 "BLOCK_N", "BLOCK_K", "BLOCK_T")}, "stages": l.options.get("num_stages")}
                 for l in rec.launches.values() if l.name in ("_fp8_block_gemm_kernel", "_moe_gate_up_kernel",
                                                               "_moe_down_kernel", "_dsv4_index_logits_kernel")}
    with aot_check.recording(TARGETS[name]) as rec:  # one token, fp32 activations (the oracle path)
        dsv4_moe_fp8(e(1, 4096, dtype=torch.float32), ids(1, 6, 256), e(1, 6, dtype=torch.float32),
                     e(256, 4096, 4096, dtype=fp8), e(256, 2, 16, 32, dtype=torch.float32),
                     e(256, 4096, 2048, dtype=fp8), e(256, 1, 32, 16, dtype=torch.float32), 10.0)
    out[name]["fp32 decode gate_up stages"] = [l.options["num_stages"] for l in rec.launches.values()
                                               if l.name == "_moe_gate_up_kernel"]
print(json.dumps(out))
"""


def test_wrappers_launch_the_targets_choices():
    """Recorded launches of the FP8 GEMM (W8A16, 32 rows), the FP8 experts (1000 tokens) and the verify rows' index
    logits: gfx950 takes ieee dots (its Triton has no tf32), gfx942 and sm90 tf32; ROCm takes the LDS-sized tiles,
    sm90 the measured ones, except where shared memory is short: one token's FP8 experts with fp32 activations run
    the gate-up at 2 stages on sm90 too (~10 s: one process without the interpreter)."""
    pytest.importorskip("triton.backends.amd")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", RECORD], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert [got[t].pop("fp32 decode gate_up stages") for t in ("gfx942", "gfx950", "sm90")] == [[2], [2], [2]]
    prec = {t: {k: v.get("PREC", v.get("DOT_PRECISION")) for k, v in got[t].items()} for t in got}
    assert set(prec["gfx950"].values()) == {"ieee"} and set(prec["gfx942"].values()) == {"tf32"} == \
        set(prec["sm90"].values()), prec
    assert got["gfx942"]["_fp8_block_gemm_kernel"]["stages"] == 3 and got["sm90"]["_fp8_block_gemm_kernel"][
        "stages"] == 4
    assert [got[t]["_dsv4_index_logits_kernel"]["BLOCK_T"] for t in ("gfx942", "gfx950", "sm90")] == [2, 2, 8]
    assert [got[t]["_moe_gate_up_kernel"]["BLOCK_N"] for t in ("gfx942", "gfx950", "sm90")] == [32, 64, 64]
    assert [got[t]["_moe_gate_up_kernel"]["BLOCK_K"] for t in ("gfx942", "gfx950", "sm90")] == [64, 64, 128]
    assert [got[t]["_moe_down_kernel"]["stages"] for t in ("gfx942", "gfx950", "sm90")] == [2, 2, 3]
