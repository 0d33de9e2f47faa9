"""Which kernel an FP8 linear runs (layers/quantization/fp8.py `fp8_path`) at Flash's shapes and the row counts the
engine sees, in CUDA graphs and eagerly: the H200 measurements of 2026-12-03 (benchmark/RESULTS.md) as a table, on a
simulated sm90 GPU with cuBLAS's blockwise recipe, without it, with SGLANG_DSV4_FP8_PREFILL=dequant, without FP8
MMA, and in fp32."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.quantization import fp8

# (name, N per group, K, groups) of Flash's FP8 linears
WQ_A, WQ_B, WKV, WO_A, WO_B, IDX_WQ_B = (1024, 4096, 1), (32768, 1024, 1), (512, 4096, 1), (1024, 4096, 8), \
    (4096, 8192, 1), (8192, 1024, 1)
GPU = torch.device("cuda", 0)


@pytest.fixture
def sm90(monkeypatch):
    """A GPU with FP8 MMA and cuBLAS's blockwise recipe (shape rules kept, the probe skipped)."""
    monkeypatch.setattr(fp8, "fp8_mma_supported", lambda device: True)
    monkeypatch.setattr(fp8, "_CUBLAS_OK", {str(GPU): True})


@pytest.mark.parametrize("shape,m,path", [
    (WQ_B, 1, "w8a8"), (WO_A, 64, "w8a8"), (WQ_A, 32, "w8a8"),  # decode / verify rows
    (WQ_B, 65, "cublas_w8a8"), (WO_B, 128, "cublas_w8a8"), (IDX_WQ_B, 1024, "cublas_w8a8"),  # wide weights
    (WQ_A, 128, "dequant"), (WKV, 2047, "dequant"), (WQ_A, 2048, "cublas_w8a8"), (WKV, 8192, "cublas_w8a8"),
    (WO_A, 512, "w8a8"), (WO_A, 513, "dequant"), (WO_A, 2048, "cublas_w8a8"),  # grouped wo_a
])
def test_graph_paths_on_sm90(sm90, shape, m, path):
    n, k, groups = shape
    assert fp8.fp8_path(m, n, k, groups, torch.bfloat16, GPU, graph=True) == path


@pytest.mark.parametrize("shape,m,path", [
    (WQ_B, 1, "w8a8"), (WO_A, 64, "w8a8"),  # the same function as in graphs
    (WQ_B, 65, "dequant"), (WO_A, 256, "dequant"), (WO_B, 4095, "dequant"),  # cuBLAS's host time not hidden
    (WQ_A, 4096, "cublas_w8a8"), (WO_A, 8192, "cublas_w8a8"), (IDX_WQ_B, 4096, "cublas_w8a8"),  # long chunks
])
def test_eager_paths_on_sm90(sm90, shape, m, path):
    n, k, groups = shape
    assert fp8.fp8_path(m, n, k, groups, torch.bfloat16, GPU, graph=False) == path


def test_without_cublas_recipe_or_forced_dequant(sm90, monkeypatch):
    monkeypatch.setattr(fp8, "_CUBLAS_OK", {str(GPU): False})
    assert [fp8.fp8_path(m, *WQ_B, torch.bfloat16, GPU, True) for m in (1, 128, 8192)] == \
        ["w8a8", "dequant", "dequant"]
    assert fp8.fp8_path(8192, *WQ_B, torch.bfloat16, GPU, False) == "dequant"
    assert fp8.fp8_path(256, *WO_A, torch.float16, GPU, True) == "w8a8"
    monkeypatch.setenv("SGLANG_DSV4_FP8_PREFILL", "dequant")
    monkeypatch.setattr(fp8, "_CUBLAS_OK", {str(GPU): True})
    assert [fp8.fp8_path(m, *shape, torch.bfloat16, GPU, True) for shape, m in [(WQ_B, 8192), (WO_A, 256), (WO_B, 1)]
            ] == ["dequant", "dequant", "w8a8"]


def test_no_fp8_mma_and_fp32(sm90, monkeypatch):
    assert [fp8.fp8_path(m, *WO_B, torch.float32, GPU, graph) for m in (1, 64, 65, 8192) for graph in (False, True)
            ] == ["w8a16"] * 4 + ["dequant"] * 4
    monkeypatch.setattr(fp8, "fp8_mma_supported", lambda device: False)
    monkeypatch.setattr(fp8, "_CUBLAS_OK", {str(GPU): False})
    assert [fp8.fp8_path(m, *WO_A, torch.bfloat16, GPU, True) for m in (1, 256)] == ["w8a16", "dequant"]


def test_cuda_only():
    assert not fp8.fp8_mma_supported(torch.device("cpu"))


def test_graph_capture_region():
    """The graph runner's warm-up and capture runs are marked (utils/graph_capture), nested and exception-safe, so
    fp8_linear picks the graph rule for the warm-up that compiles what the capture records."""
    from sglang.srt.utils.graph_capture import graph_capture_region, in_graph_capture

    assert not in_graph_capture()
    with graph_capture_region():
        assert in_graph_capture()
        with pytest.raises(RuntimeError):
            with graph_capture_region():
                raise RuntimeError("a failed warm-up")
        assert in_graph_capture()
    assert not in_graph_capture()
