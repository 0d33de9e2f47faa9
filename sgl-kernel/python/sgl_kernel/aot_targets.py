"""The GPU targets the ahead-of-time compile check (aot_check) builds for, and what the engine's wrappers would see on
each: the one table of per-target facts (FP8 dtype, warp size, shared memory, SM / CU count, TMA, PDL) that the
launch plan (aot_plan) and the check read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


# gfx942 (MI300X) has no OCP e4m3: its FP8 is e4m3fnuz (Triton's fp8e4b8). sm90 / sm100: 227 KiB of the SM's 228 KiB
# shared memory per block; gfx942 64 KiB of LDS per workgroup, gfx950 (MI355X) 160 KiB.
TARGETS = {
    "gfx942": AotTarget("gfx942", "hip", "gfx942", 64, 64 * 1024, 304, torch.float8_e4m3fnuz),
    "gfx950": AotTarget("gfx950", "hip", "gfx950", 64, 160 * 1024, 256, torch.float8_e4m3fn),
    "sm90": AotTarget("sm90", "cuda", 90, 32, 227 * 1024, 132, torch.float8_e4m3fn),
    "sm100": AotTarget("sm100", "cuda", 100, 32, 227 * 1024, 148, torch.float8_e4m3fn),
}
DEFAULT_TARGETS = ("gfx942", "gfx950", "sm90")
