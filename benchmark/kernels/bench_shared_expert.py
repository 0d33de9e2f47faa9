"""Benchmark of the MoE's shared expert and the routed + shared sum, as the engine ran them and as it runs them now,
at Flash widths with the hub's formats (hidden 4096, moe_intermediate 2048, FP8 shared expert, 256 MXFP4 routed
experts top-6, bf16 activations).

- before: w13 (FP8 GEMM of the norm's quantized rows), torch's clamped SwiGLU (two clamps, silu, product), w2
  (activation quantization + FP8 GEMM), the routed experts, then `routed + shared`;
- after: w13, the SwiGLU quantized for w2 in one launch (sgl_kernel.dsv4_swiglu), w2's GEMM, the routed experts
  whose last kernel adds the shared output.
Per case (1, 8, 32, 128 rows): the shared expert + sum's kernels per call and their GPU time (time_cuda_us, both
paths), the whole MoE's (router excluded) time per call as a CUDA graph replays it (launch gaps included), and the
same run's copy bandwidth. The FP8 paths are the ones a graph capture picks (graph_capture_region).

    python benchmark/kernels/bench_shared_expert.py
"""

from __future__ import annotations

import os
import sys

import torch

from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant
from sgl_kernel.dsv4_moe import dsv4_moe_mxfp4
from sglang.srt.layers.moe.experts import SharedExpert, clamped_swiglu
from sglang.srt.layers.quantization.fp8 import Fp8Activation, Fp8BlockLinear, w8a8_input_path
from sglang.srt.utils.graph_capture import graph_capture_region

try:
    from .common import copy_bandwidth_gbps, time_cuda_us
    from .bench_dsv4_router import kernels_per_call, time_graph_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import copy_bandwidth_gbps, time_cuda_us
    from bench_dsv4_router import kernels_per_call, time_graph_us

D, I, E, K, LIMIT = 4096, 2048, 256, 6, 10.0
ROWS = (1, 8, 32, 128)


def _fp8_linear(n: int, k: int, g: torch.Generator) -> Fp8BlockLinear:
    linear = Fp8BlockLinear(k, n).cuda()
    with torch.no_grad():
        linear.weight.copy_((torch.randn(n, k, generator=g, device="cuda") * 64).to(torch.float8_e4m3fn))
        linear.weight_scale_inv.copy_(torch.full_like(linear.weight_scale_inv, 2.0 ** -6 * k ** -0.5))
    return linear


def _packed(n: int, k: int, g: torch.Generator) -> tuple:
    codes = torch.randint(0, 256, (E, n, k // 2), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(118, 124, (E, n, k // 32), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    return codes, scale


def main() -> None:
    torch.manual_seed(0)
    g = torch.Generator("cuda").manual_seed(0)
    shared = SharedExpert(D, I, LIMIT)
    shared.w13, shared.w2 = _fp8_linear(2 * I, D, g), _fp8_linear(D, I, g)
    w13, s13 = _packed(2 * I, D, g)
    w2, s2 = _packed(D, I, g)
    copy = copy_bandwidth_gbps()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {copy:.0f} GB/s (read + write); hidden {D}, "
          f"intermediate {I}, {E} MXFP4 experts top-{K}, FP8 shared expert, bf16")
    print("rows | shared+sum kernels before -> after | shared+sum GPU us before -> after | MoE graph us before -> "
          "after | equal")
    for rows in ROWS:
        x = (torch.randn(rows, D, generator=g, device="cuda") * 0.5).bfloat16()
        ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(rows)])
        weights = torch.rand(rows, K, device="cuda")
        routed = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, LIMIT, gemv=True)  # compiled, fixed for "sum"
        with graph_capture_region():
            path = w8a8_input_path(shared.w13, x)
            q, s = dsv4_fp8_act_quant(x, cublas_layout=path == "cublas_w8a8")
            x_in = Fp8Activation(q, s, rows, x.dtype, path)  # the ffn norm's quantized rows

            def shared_before():
                gate, up = shared.w13(x_in).chunk(2, dim=-1)
                return shared.w2(clamped_swiglu(gate, up, LIMIT))

            def sum_before():
                return routed + shared_before()

            def sum_after():  # the routed kernel's own launches are not counted: the add rides in them
                return dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, LIMIT, gemv=True, add=shared(x_in))

            def moe_before():
                return dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, LIMIT, gemv=True) + shared_before()

            equal = torch.equal(sum_after(), moe_before())
            routed_kernels = kernels_per_call(lambda: dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, LIMIT,
                                                                     gemv=True))
            routed_us = time_cuda_us(lambda: dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, LIMIT, gemv=True))
            k_before, k_after = kernels_per_call(sum_before), kernels_per_call(sum_after) - routed_kernels
            t_before, t_after = time_cuda_us(sum_before), time_cuda_us(sum_after) - routed_us
            graph_before, graph_after = time_graph_us(moe_before), time_graph_us(sum_after)
        print(f"{rows:4d} | {k_before:.0f} -> {k_after:.0f} | {t_before:.1f} -> {t_after:.1f} | {graph_before:.1f} -> "
              f"{graph_after:.1f} | {equal}")


if __name__ == "__main__":
    main()
