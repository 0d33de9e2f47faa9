"""What the kernels' wrappers need to know of the GPU they launch on, in one place: the ROCm architecture (the AMD
targets differ in what Triton's dot takes and in LDS size), the dot precision that follows from it, the shared
memory (LDS) a program may use, and the e4m3 flavour of FP8 per target (the one table: aot_targets and sglang's
layers/quantization/fp8_format read it).

NVIDIA launches keep their measured settings: every answer here is the NVIDIA one unless `hip_arch` names an AMD
architecture. The ahead-of-time check (aot_check) answers `hip_arch` for the target it compiles for.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

# The e4m3 flavour of FP8 weights and activations per target, as the compilers name targets. gfx942 (MI300X /
# MI325X) has no OCP e4m3 MMA: its FP8 is e4m3fnuz (Triton's fp8e4b8); gfx950 (MI355X) and NVIDIA take OCP e4m3fn.
FP8_DTYPE_BY_TARGET = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn,
                       "sm90": torch.float8_e4m3fn, "sm100": torch.float8_e4m3fn}
# LDS bytes one workgroup may use: 64 KiB on CDNA3, 160 KiB on CDNA4; an architecture not listed gets CDNA3's.
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
LDS_BYTES_DEFAULT = 64 * 1024
# AMD architectures whose Triton dot takes input_precision "tf32" (CDNA3's xf32 MFMA); CDNA4 dropped xf32, and
# Triton's gfx950 backend rejects "tf32" (it takes ieee / bf16x3 / bf16x6).
TF32_HIP_ARCHS = frozenset({"gfx942"})


def fp8_dtype_for(target: Optional[str]) -> torch.dtype:
    """The e4m3 dtype of a target named as the compilers name it ("gfx942", "gfx950", "sm90", ...; a gfx name may
    carry target features, "gfx942:sramecc+:xnack-"); OCP e4m3fn for any other name, "cuda", "cpu" or None."""
    return FP8_DTYPE_BY_TARGET.get((target or "").split(":")[0], torch.float8_e4m3fn)


def hip_arch(device: torch.device) -> Optional[str]:
    """The AMD architecture ("gfx942", "gfx950", ...) of a ROCm device; None on NVIDIA GPUs and the CPU."""
    if device.type != "cuda" or torch.version.hip is None:
        return None
    return _gcn_arch(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _gcn_arch(index: int) -> str:
    return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot's input_precision for operands of `dtype`: fp32 runs (the fp32 engine, the oracle checks) stay exact
    ("ieee"); others "tf32" (where their operands are fp32 tiles: the fast path NVIDIA and gfx942 have), but "ieee"
    on an AMD architecture without tf32 (gfx950)."""
    if dtype == torch.float32:
        return "ieee"
    arch = hip_arch(device)
    return "tf32" if arch is None or arch in TF32_HIP_ARCHS else "ieee"


def shared_memory_limit(device: torch.device) -> Optional[int]:
    """The shared memory bytes one program may use on an NVIDIA GPU (Triton's `max_shared_mem`, the opt-in per-block
    size its launcher checks a kernel against: 227 KiB on H100 / H200); None on ROCm (`lds_limit`) and the CPU."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return _max_shared_mem(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _max_shared_mem(index: int) -> int:
    import triton
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def nvidia_arch(device: torch.device) -> Optional[int]:
    """An NVIDIA GPU's compute capability x10 (90 Hopper, 100 Blackwell); None on ROCm and the CPU."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def lds_limit(device: torch.device) -> Optional[int]:
    """The LDS bytes a workgroup may use on a ROCm device (its tiles and stages must fit them); None elsewhere (the
    NVIDIA settings were sized for 227 KiB and measured)."""
    arch = hip_arch(device)
    return None if arch is None else LDS_BYTES.get(arch, LDS_BYTES_DEFAULT)
