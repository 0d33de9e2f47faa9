"""The GPU targets the ahead-of-time compile check (aot_check) builds for, and what the engine's wrappers would see on
each: the one table of per-target facts (FP8 dtype, warp size, shared memory, SM / CU count, TMA, PDL) that the
launch plan (aot_plan) and the check read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kernel.dsv4_target import LDS_BYTES, fp8_dtype_for


@dataclass(frozen=True)
class AotTarget:
    name: str
    backend: str  # "cuda" | "hip"
    arch: object  # 90 / 100 (NVIDIA compute capability x10) or "gfx942" / "gfx950"
    warp_size: int
    shared_limit: int  # bytes of shared memory (LDS) one program may use
    num_sms: int  # SMs / CUs: the wrappers size split-K and key splits by it
    fp8_dtype: torch.dtype  # the e4m3 flavour of FP8 weights and activations on this target

    @property
    def nvidia(self) -> bool:
        return self.backend == "cuda"

    @property
    def tma(self) -> bool:  # TMA tensor descriptors: NVIDIA sm90 and later
        return self.nvidia and self.arch >= 90

    @property
    def pdl(self) -> bool:  # programmatic dependent launch: NVIDIA sm90 and later
        return self.nvidia and self.arch >= 90

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget(self.backend, self.arch, self.warp_size)


# FP8 dtypes and LDS sizes from dsv4_target (what the wrappers read on a GPU). sm90 / sm100: 227 KiB of the SM's
# 228 KiB shared memory per block.
TARGETS = {
    "gfx942": AotTarget("gfx942", "hip", "gfx942", 64, LDS_BYTES["gfx942"], 304, fp8_dtype_for("gfx942")),
    "gfx950": AotTarget("gfx950", "hip", "gfx950", 64, LDS_BYTES["gfx950"], 256, fp8_dtype_for("gfx950")),
    "sm90": AotTarget("sm90", "cuda", 90, 32, 227 * 1024, 132, fp8_dtype_for("sm90")),
    "sm100": AotTarget("sm100", "cuda", 100, 32, 227 * 1024, 148, fp8_dtype_for("sm100")),
}
DEFAULT_TARGETS = ("gfx942", "gfx950", "sm90")
