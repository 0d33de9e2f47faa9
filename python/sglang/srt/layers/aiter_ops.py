"""AITER (AMD's kernel library) where it is a drop-in swap for an op we run; our Triton / torch kernels elsewhere.

An op uses AITER only when all of these hold, checked at call time: the tensor is on the GPU, the platform is ROCm
(`platform.is_hip()`), `aiter` is importable (`platform.aiter_available()`; imported lazily on first use, never at
import time), and SGLANG_USE_AITER is not 0 (default auto = on for ROCm). ROCm without AITER falls back to our
kernels and logs one warning per process.

The swap is wired only where AITER computes the same function on our tensors as they are; `AITER_OPS` records,
per op, the AITER API looked at and why it is or is not used (docs/platforms.md shows the same table).

AITER API followed: ROCm/aiter main as of 2026 (files named in AITER_OPS). The one call made,
`aiter.rmsnorm2d_fwd(input, weight, epsilon, use_model_sensitive_rmsnorm=0) -> Tensor` (aiter/ops/rmsnorm.py,
re-exported by aiter/__init__.py), needs weight.dtype == input.dtype and fp16/bf16/fp32; confirmed from the
source, not run (no AMD GPU here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt import platform as plat
from sglang.srt.environ import envs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AiterOp:
    op: str
    aiter_api: str  # the AITER function (and file) that computes this op
    used: bool
    reason: str


AITER_OPS = (
    AiterOp("RMSNorm (weighted and unweighted)", "aiter.rmsnorm2d_fwd (aiter/ops/rmsnorm.py)", True,
            "same function: fp32 math, one rounding to x's dtype; our fp32 norm weights are passed in x's dtype "
            "when that cast is exact (bf16 checkpoint weights), else AITER runs in fp32"),
    AiterOp("indexer logits FP8", "fp8_mqa_logits (aiter/ops/triton/attention/fp8_mqa_logits.py), "
            "deepgemm_fp8_paged_mqa_logits (.../pa_mqa_logits.py)", False,
            "AITER not used: semantics differ (its queries are FP8; ours stay in the compute dtype) and layout "
            "differs (contiguous [start, end) key ranges or a page table; ours: per-request candidate slot lists)"),
    AiterOp("indexer logits FP4", "aiter/ops/triton/attention/pa_mqa_logits_mxfp4.py", False,
            "AITER not used: layout differs (pages of [values | e8m0 scales] pre-shuffled in MFMA order; ours: "
            "one row per entry, codes then scales)"),
    AiterOp("MoE experts", "fused_moe (aiter/fused_moe.py); fused_clamp_act_mul "
            "(aiter/ops/triton/fusions/fused_clamp_act_mul.py)", False,
            "AITER not used: fused_moe's Silu has no swiglu_limit clamp (DeepSeek-V4 clamps every expert); "
            "fused_clamp_act_mul has the V4 clamp but wants gate|up in one [M, 2I] tensor (merged w1|w3 weights)"),
    AiterOp("mHC pre/post", "fused_mhc / mhc (aiter/ops/triton/fusions/mhc.py)", False,
            "AITER not used: semantics differ (no +hc_eps on pre, log-domain Sinkhorn without eps, mixes "
            "rounded to x's dtype; ours are fp32)"),
    AiterOp("sparse attention", "aiter/ops/triton/attention/sparse_attention_dsv4.py", False,
            "AITER not used: not evaluated yet; our Triton kernel reads our FP8 KV layout directly"),
)


@dataclass
class _State:
    warned: bool = False  # the one "ROCm without AITER" warning of the process
    module: Optional[object] = None  # the imported `aiter`
    import_failed: bool = False


_state = _State()


def reset() -> None:
    """Forget the imported module and the warning (tests switch simulated platforms and stub modules)."""
    global _state
    _state = _State()


def _warn_once(why: str) -> None:
    if not _state.warned:
        _state.warned = True
        logger.warning("ROCm without AITER (%s): using the Triton / torch kernels. Install aiter for the AITER "
                       "kernels, or set SGLANG_USE_AITER=0 to choose this explicitly.", why)


def aiter_wanted() -> bool:
    """ROCm, AITER installed and not switched off (does not import it). Warns once when ROCm lacks AITER."""
    if not plat.is_hip() or envs.SGLANG_USE_AITER.get() is False:
        return False
    if not plat.aiter_available():
        _warn_once("the aiter package is not installed")
        return False
    return True


def _module():
    if _state.module is None and not _state.import_failed:
        try:
            import aiter
        except Exception as e:  # ImportError, or AITER's JIT failing while the package imports
            _state.import_failed = True
            _warn_once(f"import aiter failed: {e}")
        else:
            _state.module = aiter
    return _state.module


def use_aiter(x: torch.Tensor) -> bool:
    """Whether an op on `x` should call AITER (cheapest checks first: most calls are on CUDA or CPU)."""
    return plat.is_device_tensor(x) and aiter_wanted() and _module() is not None


_ONES: dict = {}


def _ones(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dim, dtype, device)
    if key not in _ONES:
        _ONES[key] = torch.ones(dim, dtype=dtype, device=device)
    return _ONES[key]


def _weight_as(weight: torch.Tensor, dtype: torch.dtype, cache: dict) -> Optional[torch.Tensor]:
    """`weight` in `dtype` if the cast is exact, else None; decided once per dtype (one host sync, at the first
    call, after loading). Checkpoint norm weights are bf16, so in practice the cast is exact."""
    if dtype not in cache:
        cast = weight.detach().to(dtype)
        cache[dtype] = cast if torch.equal(cast.float(), weight.detach().float()) else None
    return cache[dtype]


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
             weight_cache: Optional[dict] = None) -> torch.Tensor:
    """AITER's RMSNorm with our semantics: weight * x / rms(x) in fp32, cast once to x's dtype; weight None is the
    unweighted norm. AITER wants the weight in x's dtype, ours are fp32 (model_runner keeps norm weights fp32):
    an exact cast (`weight_cache` holds it, per module) is passed as is; otherwise AITER runs in fp32 and the
    result is cast once (rounding the weight would change the function). Rows are flattened to 2-D, the shape
    rmsnorm2d_fwd is named for. That AITER multiplies the weight before its one rounding is read from its
    docstring ("rmsnorm(input) * weight, fp32 accumulate"), not checked on hardware."""
    aiter = _module()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()  # row-strided views (a joined projection's split) made dense
    if weight is None:
        w = _ones(shape[-1], x.dtype, x.device)
    elif weight.dtype == x.dtype:
        w = weight
    else:
        w = _weight_as(weight, x.dtype, weight_cache if weight_cache is not None else {})
        if w is None:
            return aiter.rmsnorm2d_fwd(x2.float(), weight.float(), eps).to(x.dtype).view(shape)
    return aiter.rmsnorm2d_fwd(x2, w, eps).view(shape)
