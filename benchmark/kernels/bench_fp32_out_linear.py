"""Benchmark of the fp32-output projections (layers/fp32_linear.py) on Flash widths: the fp32 GEMM of x.float() and
an fp32-kept weight (the engine's path before its weights were kept bf16) against linear_fp32_out's bf16 GEMM with
fp32 output on the same bf16 values, and the fused decode kernels (dsv4_compressor_proj, dsv4_router) reading an fp32
or a bf16 weight, beside the torch paths they replace at their rows (to re-decide FUSED_PROJ_MAX_ROWS and the
router's FUSED_MAX_ROWS).

Weights: the attention's CSA compressor joined wkv | wgate [2048, 4096], the indexer's [512, 4096], an HCA
compressor's [1024, 4096], the router's [256, 4096]; rows 1, 2, 8, 32, 128, 8192 of bf16 x. Per case: GPU time of one
call (time_cuda_us: kernel time only) and of a CUDA-graph replay (launch gaps included, as decode pays them), the new
path's bytes (weight + x + fp32 output) as a fraction of the same run's copy bandwidth, and max |new - old| (fp32
summation order only: the products are exact either way).

    python benchmark/kernels/bench_fp32_out_linear.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from sgl_kernel.dsv4_compressor_proj import dsv4_compressor_proj, dsv4_compressor_proj_ref
from sgl_kernel.dsv4_router import dsv4_router
from sglang.srt.layers.fp32_linear import linear_fp32_out, uses_tensor_cores

try:
    from .bench_dsv4_router import time_graph_us
    from .common import copy_bandwidth_gbps, time_cuda_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_dsv4_router import time_graph_us
    from common import copy_bandwidth_gbps, time_cuda_us

D = 4096
WEIGHTS = {"csa-compressor": 2048, "csa-indexer-compressor": 512, "hca-compressor": 1024, "router": 256}
ROWS = (1, 2, 8, 32, 128, 8192)


def _weight(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(n, D, generator=g, device="cuda") * D ** -0.5).bfloat16()


def _x(rows: int) -> torch.Tensor:
    g = torch.Generator("cuda").manual_seed(rows)
    return torch.randn(rows, D, generator=g, device="cuda").bfloat16()


def gemm_rows(copy: float) -> None:
    print(f"{'weight':24s} {'rows':>5s} | {'fp32 GEMM':>9s} {'graph':>8s} | {'bf16->fp32':>10s} {'graph':>8s} "
          f"{'frac':>5s} | {'max|diff|':>9s}   (us)")
    for i, (name, n) in enumerate(WEIGHTS.items()):
        w16 = _weight(n, i)
        w32 = w16.float()  # the same values, kept fp32 as before
        for rows in ROWS:
            x = _x(rows)

            def old():
                return F.linear(x.float(), w32)

            def new():
                return linear_fp32_out(x, w16)

            diff = (new() - old()).abs().max().item()
            t_new = time_cuda_us(new)
            frac = (n * D * 2 + rows * D * 2 + rows * n * 4) / (t_new * 1e-6) / 1e9 / copy
            print(f"{name:24s} {rows:5d} | {time_cuda_us(old):9.2f} {time_graph_us(old):8.2f} | {t_new:10.2f} "
                  f"{time_graph_us(new):8.2f} {frac:5.2f} | {diff:9.2e}")


def fused_rows() -> None:
    """The fused kernels with either weight dtype, beside the engine's torch path (bf16 weights) at their rows."""
    ws = [_weight(2048, 0), _weight(512, 1)]
    apes = [torch.zeros(4, 1024, device="cuda"), torch.zeros(4, 256, device="cuda")]
    wi = _weight(64, 2)
    print("\ndsv4_compressor_proj (CSA: both compressors + index weights), graph replay us: "
          "fp32 weights / bf16 weights / torch path with bf16 weights; max|diff| of the kernels and the reference")
    for rows in (1, 2, 4, 8):
        x, off = _x(rows), torch.zeros(rows, dtype=torch.int64, device="cuda")
        w32 = [w.float() for w in ws]

        def torch_path():  # Compressor.project of both compressors + the indexer's weights_proj
            return ([linear_fp32_out(x, w) for w in ws], F.linear(x, wi).float() * 0.125)

        a = dsv4_compressor_proj(x, off, w32, apes, wi, 0.125)[0]
        b = dsv4_compressor_proj(x, off, ws, apes, wi, 0.125)[0]
        r = dsv4_compressor_proj_ref(x, off, w32, apes, wi, 0.125)[0]
        diff = max((p - q).abs().max().item() for p, q in zip(a + a, b + r))
        print(f"  rows {rows:3d}: {time_graph_us(lambda: dsv4_compressor_proj(x, off, w32, apes, wi, 0.125)):7.2f} "
              f"{time_graph_us(lambda: dsv4_compressor_proj(x, off, ws, apes, wi, 0.125)):7.2f} "
              f"{time_graph_us(torch_path):7.2f}   max|diff| {diff:.2e}")
    w16 = _weight(256, 3)
    bias = torch.zeros(256, device="cuda")
    print("dsv4_router (score layer, top-6 + shared column), graph replay us: fp32 weight / bf16 weight / the torch "
          "path's logits GEMM alone with the bf16 weight")
    for rows in (1, 8, 16, 32, 64, 128):
        x = _x(rows)
        fused = [time_graph_us(lambda w=w: dsv4_router(x, w, bias, None, None, 6, 1.5, None, 256))
                 for w in (w16.float(), w16)]
        gemm = time_graph_us(lambda: linear_fp32_out(x, w16))
        print(f"  rows {rows:3d}: {fused[0]:7.2f} {fused[1]:7.2f} {gemm:7.2f}")


if __name__ == "__main__":
    copy = copy_bandwidth_gbps()
    x0 = _x(1)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; copy bandwidth {copy:.0f} GB/s (same run); "
          f"bf16 GEMM with fp32 output: {uses_tensor_cores(x0, _weight(8, 9))}")
    gemm_rows(copy)
    fused_rows()
