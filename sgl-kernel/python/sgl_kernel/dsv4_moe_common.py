"""What the fused MoE's path modules share (dsv4_moe_general, dsv4_moe_planes, dsv4_moe_gemv), so none of them
imports the door (dsv4_moe) that picks among them: the launch settings (`MoeLaunch`, `MoeConfig`), the MXFP4 block
size, the exact e2m1 value of a code and the block-major order of the block-by-tile kernels' programs."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

FP4_BLOCK = 32  # inputs per ue8m0 scale byte (the MXFP4 block)


@dataclass(frozen=True)
class MoeLaunch:
    """One kernel's tile and launch settings."""
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    scaled_dot: bool = True  # bf16 / fp16 activations x MXFP4 weights through tl.dot_scaled
    # K splits of the parity planes' kernels (more programs, each with a shorter K loop: a few tokens' experts); the
    # general kernels run unsplit (their splits lost at every decode size measured, tying one token's down at best)
    split_k: int = 1
    # scaled dot: weight codes through a TMA tensor descriptor (no per-element address registers, copies the compiler
    # pipelines; 5-30% faster for most decode launches on an H200)
    tma: bool = False
    # MXFP4 codes as parity planes (dsv4_moe_planes: PTX on NVIDIA GPUs, ~2.25 instructions per weight against the
    # scaled dot's 5.5-7.3) times the activations split by parity; bf16 or fp32 activations, scales checked at load
    planes: bool = False
    swap: bool = False  # planes: the planes as the MMA's first operand (mma.sync at 2 warps)
    # planes: a register cap per thread (Triton's maxnreg, NVIDIA only): fewer registers let more programs share an SM
    # (one token's gate-up takes ~141 at 4 warps: 3 programs per SM; 128 allows 4), at the risk of spills
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if self.split_k < 1 or (self.split_k > 1 and not self.planes):
            raise ValueError(f"MoeLaunch.split_k splits the parity planes' kernels (planes=True) over K; the general "
                             f"kernels run unsplit: got split_k {self.split_k} with planes={self.planes}")

    def launch_options(self) -> dict:
        """Compile options beyond warps and stages (none unless set: HIP's and the interpreter's launchers take no
        maxnreg)."""
        return {"maxnreg": self.maxnreg} if self.maxnreg else {}


@dataclass(frozen=True)
class MoeConfig:
    """Rows per expert block (both kernels) and each kernel's launch; pdl: the parity planes' decode chain (align,
    gate-up, SwiGLU over splits, down, combine) as programmatic dependent launches where the GPU has them
    (dsv4_pdl.pdl_supported)."""
    block_m: int
    gate_up: MoeLaunch
    down: MoeLaunch
    pdl: bool = True


@triton.jit
def e2m1_value(code):
    """e2m1 codes (int32, 0..15) -> fp32 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 (bit 3 the sign), exactly: the code's sign,
    exponent and mantissa bits placed in an fp16 (sign at 15, exponent at 10-11, mantissa at 9) are the value times
    2^-14 (e = 0 lands on fp16 subnormals, which hold 0.5 * 2^-14 exactly); no table, no branches."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def block_and_tile(N, BLOCK_N: tl.constexpr):
    """This program's (expert block, output tile) on a 1-D grid of blocks x cdiv(N, BLOCK_N) tiles, a block's tiles
    consecutive: its activation rows come from DRAM once and from L2 for the other tiles' programs, which run beside
    it; consecutive blocks mostly share an expert, whose weight tiles they then share in L2 too. Block-fastest, each
    tile's programs re-read every block's rows from DRAM: Flash's gate-up (32 tiles of 64) then moves ~15 GB a layer
    at 8,192 prefill tokens and ~6.4 GB at 1,024, 5.1 / 2.1 ms at an H100's copy bandwidth against the 5.7 / 2.0 ms
    it took (RESULTS.md "Prefill", 2026-12-07): bound by those re-reads, not by its MMAs."""
    tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    return pid // tiles, pid % tiles


def block_major_grid(num_blocks: int, n: int, block_n: int) -> tuple:
    """The grid of block_and_tile's programs."""
    return (num_blocks * triton.cdiv(n, block_n),)
