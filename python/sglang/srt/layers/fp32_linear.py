"""Linears whose result is fp32: the compressors' projections and the router's logits (docs/dsv4-architecture.md 5.4
and 6: "computed in fp32").

Their weights are bf16 values (the checkpoint stores them bf16; model_builder keeps them bf16 where every loaded value
is one). x . W^T of bf16 x and bf16 W in fp32 is then a bf16 tensor-core GEMM with fp32 accumulation and fp32 output:
a bf16 x bf16 product is exact in fp32, so it is the fp32 GEMM of the same values up to the order of the fp32 sums
(which cuBLAS's choice of algorithm changes anyway), at a fraction of the fp32 GEMM's (FFMA) time. Elsewhere (fp32 x:
the fp32 engine; the CPU, where aten's mm has no out_dtype; fp16 x) the fp32 GEMM of x.float() and W.float(), as the
reference computes it: with fp32 x and W those casts are no-ops, so the fp32 engine's values do not change.

The choice depends only on dtypes and the device, so an eager step and its CUDA-graph capture take the same path.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from sglang.srt import platform as plat


@functools.lru_cache(maxsize=None)
def mm_out_dtype_available() -> bool:
    """Whether this torch has a CUDA kernel for aten::mm.dtype (torch.mm(a, b, out_dtype=...), torch >= 2.8): a
    lookup in the dispatcher's table, no launch (safe to first ask during CUDA-graph capture). NVIDIA only: ROCm
    keeps the fp32 GEMM (its builds register their kernels under the same key, hipBLASLt's support unchecked)."""
    if torch.version.hip is not None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA")
    except (AttributeError, RuntimeError):  # an older torch: no such operator
        return False


def bf16_weights_supported(device: torch.device) -> bool:
    """Whether the engine keeps these weights bf16 on `device`: NVIDIA GPUs (the bf16 GEMM with fp32 output; the
    fused decode kernels read them as stored) and the CPU (which widens them per call: its speed does not matter).
    ROCm keeps them fp32: without the fp32-output GEMM its prefill would widen a weight copy at every call. A
    function of the device only, so the capacity planner counts what the server builds, on any machine."""
    return device.type == "cpu" or (device.type == "cuda" and not plat.is_hip())


def _on_cuda(t: torch.Tensor) -> bool:
    """A real CUDA tensor (a simulated platform's CPU tensors take the CPU path: aten has no CPU mm.dtype)."""
    return t.is_cuda


def uses_tensor_cores(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear_fp32_out(x, weight) runs as a bf16 GEMM with fp32 output (no fp32 copy of x needed)."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and _on_cuda(x) and _on_cuda(weight)
            and mm_out_dtype_available())


def linear_fp32_out(x: torch.Tensor, weight: torch.Tensor, xf: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] . weight [N, K]^T -> [..., N] fp32 (see the module docstring for the path). xf: x.float(), where
    the caller already has it (read only on the fp32 path)."""
    if uses_tensor_cores(x, weight):
        out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x.float() if xf is None else xf, weight.float())


__all__ = ["bf16_weights_supported", "linear_fp32_out", "mm_out_dtype_available", "uses_tensor_cores"]
