"""The platform's FP8 encoding: what the FP8 weights are held in, what activations are quantized to, which FP8
buffers are allocated (the one front door: `fp8_format()`, or `fp8_format_for(target)` without a live platform).

- NVIDIA GPUs, gfx950 (MI355X), CPU: OCP float8_e4m3fn (largest 448), the checkpoint's own bytes.
- gfx942 (MI300X / MI325X): float8_e4m3fnuz (largest 240), the only e4m3 its FP8 MFMA takes (Triton compiles an
  e4m3fn dot there through fp16). The two differ in exponent bias (7 / 8): the same byte read as fnuz is half its
  e4m3fn value, so a checkpoint weight keeps its bytes and its block multipliers are doubled (`to_fp8_format`);
  fnuz has no -0, and 0x80 (e4m3fn's -0) is its one NaN, so that byte becomes 0x00.

The FP8 KV cache and the indexer's FP8 keys keep e4m3fn bytes on every target: our kernels write them bit by bit
(integer rounding, no FP8 cast) and read them through a conversion to fp16 / bf16 before any dot, which Triton
compiles for gfx942 as for gfx950 and sm90, so no target needs another cache layout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from sgl_kernel.dsv4_target import fp8_dtype_for

from sglang.srt import platform as plat

logger = logging.getLogger(__name__)

# AMD architectures whose FP8 MFMA the kept FP8 weights run on, and their e4m3 encoding (sgl_kernel's per-target
# table: the kernels, the ahead-of-time check and the layers read one answer)
ROCM_FP8_ARCHS = {arch: fp8_dtype_for(arch) for arch in ("gfx950", "gfx942")}


@dataclass(frozen=True)
class Fp8Format:
    """One target's e4m3 encoding."""
    dtype: torch.dtype  # torch.float8_e4m3fn or torch.float8_e4m3fnuz
    max: float  # largest finite value: 448 (e4m3fn) or 240 (e4m3fnuz)
    checkpoint_rescale: bool  # the checkpoint's e4m3fn bytes are read as fnuz: block multipliers x2, 0x80 -> 0x00

    @property
    def triton_dtype(self) -> str:
        """The dtype's name in a Triton signature ("fp8e4nv" / "fp8e4b8"), for ahead-of-time compiles."""
        return "fp8e4b8" if self.dtype == torch.float8_e4m3fnuz else "fp8e4nv"


E4M3FN = Fp8Format(torch.float8_e4m3fn, 448.0, False)
E4M3FNUZ = Fp8Format(torch.float8_e4m3fnuz, 240.0, True)


def fp8_format_for(target: Optional[str]) -> Fp8Format:
    """The encoding of a target named as the compilers name it: "gfx942" (fnuz), "gfx950", "sm90", "sm100", "cuda",
    "cpu" or None (OCP e4m3fn). A gfx name may carry target features ("gfx942:sramecc+:xnack-")."""
    return E4M3FNUZ if fp8_dtype_for(target) == torch.float8_e4m3fnuz else E4M3FN


def fp8_format() -> Fp8Format:
    """The running (or simulated) platform's encoding: e4m3fnuz on gfx942, e4m3fn elsewhere."""
    return fp8_format_for(plat.gfx_arch() if plat.is_hip() else None)


def rocm_fp8_supported() -> bool:
    """Whether this ROCm GPU runs the kept FP8 / MXFP4 formats (gfx942, gfx950); other architectures (gfx90a: no
    FP8 MFMA) dequantize the checkpoint at load. Logged once per architecture when it does not."""
    gfx = plat.gfx_arch()
    if gfx in ROCM_FP8_ARCHS:
        return True
    if gfx not in _LOGGED:
        _LOGGED.add(gfx)
        logger.info("ROCm %s: the checkpoint's FP8 / MXFP4 weights are dequantized at load (kept quantized on %s "
                    "only)", gfx or "(architecture unknown)", " and ".join(sorted(ROCM_FP8_ARCHS)))
    return False


_LOGGED: set = set()


def e4m3fn_to_fnuz(w: torch.Tensor, scale: torch.Tensor) -> tuple:
    """The checkpoint's e4m3fn weight and its block multipliers -> (the same bytes as float8_e4m3fnuz, multipliers
    x2): every code's value times its multiplier is unchanged (exact: x2 is a power of two). e4m3fn's -0 (0x80) would
    be fnuz's NaN: it becomes 0x00; e4m3fn's NaNs (0x7F, 0xFF; none in a checkpoint) would be fnuz's +-240: they
    become its NaN, 0x80."""
    codes = w.view(torch.uint8)
    out = torch.where(codes == 0x80, 0, codes)
    out = torch.where((codes & 0x7F) == 0x7F, 0x80, out).to(torch.uint8)
    return out.view(torch.float8_e4m3fnuz), scale * 2


def to_fp8_format(w: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> tuple:
    """A checkpoint FP8 weight (e4m3fn) and its fp32 block multipliers as `fmt` holds them."""
    if w.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"checkpoint FP8 weights are float8_e4m3fn, got {w.dtype}")
    if not fmt.checkpoint_rescale:
        return w.view(torch.float8_e4m3fn), scale
    return e4m3fn_to_fnuz(w, scale)
