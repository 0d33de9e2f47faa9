"""sgl_kernel/variant_watch.py: interpreted launches keyed as a GPU's Triton compiles them. The kernels writing FP8
activations in cuBLAS's layout take its multipliers' stride (the padded rows) as an argument: two row counts of one
class (neither 1 nor divisible by 16) must compile one variant, whatever their padded rows; with rows padded to 4
they did not, and a served prefill chunk compiled five kernels (2.4 s on an H100)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="keys interpreted launches")

# 13 and 17 rows: padded to 4, 16 (divisible by 16) and 20 (not); padded to 16, both divisible
ROWS = (13, 17)


def _variants(run) -> dict:
    from sgl_kernel.aot_targets import TARGETS
    from sgl_kernel.variant_watch import watching

    with watching(TARGETS["sm90"]) as log:
        for i, m in enumerate(ROWS):
            log.phase = f"rows {m}"
            run(m, torch.Generator().manual_seed(i))
    return {m: log.new_in(f"rows {m}") for m in ROWS}


def test_act_quant_cublas_layout_one_variant():
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant
    found = _variants(lambda m, g: dsv4_fp8_act_quant(torch.randn(m, 256, generator=g), cublas_layout=True))
    assert found == {13: ["_act_quant_kernel"], 17: []}


def test_rms_norm_swiglu_rope_cublas_layout_one_variant():
    from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm_fp8
    from sgl_kernel.dsv4_rope import dsv4_rope_fp8
    from sgl_kernel.dsv4_swiglu import dsv4_clamped_swiglu_fp8

    def run(m, g):
        x = torch.randn(m, 256, generator=g, dtype=torch.bfloat16)
        dsv4_rms_norm_fp8(x, torch.ones(256), 1e-6, cublas_layout=True)
        dsv4_clamped_swiglu_fp8(x, x, 10.0, cublas_layout=True)
        dsv4_rope_fp8(x.view(m, 2, 128), torch.arange(m), 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64), True,
                      cublas_layout=True)
    found = _variants(run)
    assert sorted(found[13]) == ["_dsv4_rms_norm_kernel", "_dsv4_rope_fp8_kernel", "_swiglu_kernel"]
    assert found[17] == []


def test_watch_tells_classes_apart():
    """Row counts of other classes do compile other variants (the watch is not blind)."""
    from sgl_kernel.aot_targets import TARGETS
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant
    from sgl_kernel.variant_watch import watching

    with watching(TARGETS["sm90"]) as log:
        for m in (13, 16, 1):
            log.phase = f"rows {m}"
            dsv4_fp8_act_quant(torch.randn(m, 256), cublas_layout=True)
    assert [log.new_in(f"rows {m}") for m in (13, 16, 1)] == [["_act_quant_kernel"]] * 3
