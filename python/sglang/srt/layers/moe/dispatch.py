"""Which kernel computes the routed experts, decided here and only here, from the platform (sglang.srt.platform, the
only module that asks about hardware) and the experts' dtype and widths; `moe_path_line` words the decision for the
start-up log.

Unquantized experts (experts.RoutedExperts) take one of three paths, and never run every expert on every token:
- GROUPED: torch's grouped GEMM over the (token, slot) pairs sorted by expert (torch._grouped_mm), where torch runs it
  for the device and dtype (the CPU with torch >= 2.9; bf16 on NVIDIA Hopper or newer; bf16 on ROCm builds where the
  op runs) and the rows are whole 16-byte units (hidden and per-rank intermediate widths times the element size).
- FUSED: anywhere else on a GPU (fp32 or fp16 on any GPU, bf16 before Hopper or on ROCm builds without the op, widths
  that are not whole 16-byte units): sgl_kernel's fused Triton MoE for unquantized weights (dsv4_moe.dsv4_moe_dense).
  Like the grouped GEMM it reads nothing back: CUDA graphs capture either.
- LOOP: anywhere else on the CPU (a torch without the op, or widths it refuses): one GEMM per expert over its rows of
  the sorted pairs, which reads the per-expert counts back (the CPU runs no graphs).
Packed experts (MXFP4, FP8: layers/quantization) always take the fused Triton MoE; sgl_kernel's door words which of
its kernels run at which batch sizes (dsv4_moe.describe_mxfp4 / describe_fp8).

Under `platform.simulate_platform` CPU tensors stand for the simulated GPU's (platform.is_device_tensor): the path is
the GPU's, and the fused path runs in the Triton interpreter. A simulated NVIDIA GPU runs the grouped GEMM by the rule
(bf16 from compute capability 9.0), a simulated ROCm build has none; real devices are probed once per dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt import platform as plat

GROUPED, FUSED, LOOP = "grouped", "fused", "loop"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class MoeDevice:
    """What the dispatcher knows of where the experts run."""

    kind: str  # "cpu" | "cuda" | "rocm"
    grouped_mm: frozenset = frozenset()  # the dtypes torch._grouped_mm runs there

    @property
    def name(self) -> str:
        return "the CPU" if self.kind == "cpu" else "this GPU"


@dataclass(frozen=True)
class MoePath:
    kernel: str  # GROUPED | FUSED | LOOP
    reason: str = ""  # why not the grouped GEMM (empty when it runs)


@functools.lru_cache(maxsize=None)
def routed_path(device: MoeDevice, dtype: torch.dtype, hidden: int, intermediate: int) -> MoePath:
    """The path of unquantized experts in `dtype` with these widths (hidden, this rank's intermediate) on `device`."""
    name = DTYPE_NAMES.get(dtype, str(dtype))
    if dtype not in device.grouped_mm:
        reason = f"no grouped GEMM for {name} on {device.name}"
    else:
        size = torch.finfo(dtype).bits // 8
        odd = [(what, n) for what, n in (("hidden", hidden), ("intermediate", intermediate)) if n * size % 16]
        if not odd:
            return MoePath(GROUPED)
        what, n = odd[0]
        reason = f"torch's grouped GEMM takes rows of whole 16-byte units: {what} {n} x {size} bytes is not"
    return MoePath(LOOP if device.kind == "cpu" else FUSED, reason)


def moe_device(x: torch.Tensor) -> MoeDevice:
    """The facts for the experts' inputs `x` (cached per device and simulated platform)."""
    return _moe_device(x.device, plat.is_device_tensor(x), plat.simulated())


@functools.lru_cache(maxsize=None)
def _moe_device(device: torch.device, gpu: bool, simulated: Optional[plat.SimulatedPlatform]) -> MoeDevice:
    if not gpu:
        return MoeDevice("cpu", frozenset(d for d in FLOAT_DTYPES if _grouped_mm_runs(device, d)))
    kind = "rocm" if plat.is_hip() else "cuda"
    capability = plat.cuda_capability(device) if kind == "cuda" else None
    runs = set()
    if hasattr(torch, "_grouped_mm") and (kind == "rocm" or capability >= (9, 0)):
        # torch's GPU grouped GEMM is bf16-only; a simulated ROCm build is taken to lack it (no device to probe)
        if simulated is None:
            runs = {torch.bfloat16} if _grouped_mm_runs(device, torch.bfloat16) else set()
        elif kind == "cuda":
            runs = {torch.bfloat16}
    return MoeDevice(kind, frozenset(runs))


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """One tiny grouped GEMM against the plain product: the op exists in many builds but not for every device and
    dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(4, 16, dtype=dtype, device=device)
        b = torch.ones(2, 16, 8, dtype=dtype, device=device)
        out = torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32, device=device))
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError):
        return False


def routed_line(path: MoePath, dtype: torch.dtype) -> str:
    """The start-up log's words for unquantized experts on `path`."""
    name = DTYPE_NAMES.get(dtype, str(dtype))
    if path.kernel == GROUPED:
        return f"MoE: routed experts {name} via torch grouped GEMM"
    if path.kernel == FUSED:
        return f"MoE: routed experts {name} via the fused Triton MoE ({path.reason})"
    return f"MoE: routed experts {name} via a per-expert loop over the rows sorted by expert ({path.reason})"


def packed_line(fmt: str, device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int, limit: float,
                scales_fit_planes: bool = False, gemv: bool = False) -> str:
    """The start-up log's words for experts kept packed (`fmt` "fp4": MXFP4, "fp8"), whose activations are `dtype`."""
    from sgl_kernel.dsv4_moe import describe_fp8, describe_mxfp4

    from sglang.srt.layers.quantization.mxfp4 import scaled_dot_supported

    if fmt == "fp4":
        kernels = describe_mxfp4(device, dtype, hidden, intermediate, limit, scales_fit_planes, gemv,
                                 scaled_dot_supported())
        return f"MoE: routed experts MXFP4 kept, fused Triton MoE ({kernels})"
    return f"MoE: routed experts FP8 kept, fused Triton MoE ({describe_fp8()})"
