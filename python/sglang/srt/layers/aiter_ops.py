"""AITER (AMD's kernel library) where it is a drop-in swap for an op we run; our Triton / torch kernels elsewhere.

An op uses AITER only when all of these hold, checked at call time: the tensor is on the GPU, the platform is ROCm
(`platform.is_hip()`), `aiter` is importable (`platform.aiter_available()`; imported lazily on first use, never at
import time), and SGLANG_USE_AITER is not 0 (default auto = on for ROCm). ROCm without AITER falls back to our
kernels and logs one warning per process.

The swap is wired only where AITER computes the same function on our tensors as they are; `AITER_OPS` records,
per op, the AITER API looked at and why it is or is not used (docs/platforms.md shows the same table).

AITER API followed: ROCm/aiter main of August 2026 (files named in AITER_OPS), read from the source, not run (no
AMD GPU here). The calls made, all re-exported by aiter/__init__.py:
* `rmsnorm2d_fwd(input, weight, epsilon, use_model_sensitive_rmsnorm=0) -> Tensor` (aiter/ops/rmsnorm.py): weight
  in input's dtype, fp16/bf16/fp32.
* `mhc_pre(residual [T, 4, D] bf16, fn [24, 4D] fp32, hc_scale [3] fp32, hc_base [24] fp32, rms_eps, hc_pre_eps,
  hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight=None (bf16 [D]), norm_eps) -> (post_mix
  [T, 4, 1] fp32, comb_mix [T, 4, 4] fp32, layer_input [T, D] bf16)`; with fn [4, 4D] and sinkhorn_repeat 0 it is
  the head (pre weights only). `mhc_post(out, x [T, D], residual [T, 4, D], post_layer_mix [T, 4] fp32,
  comb_res_mix [T, 4, 4] fp32)` writes out. Both in aiter/ops/mhc.py, kernels in csrc/kernels/mhc_kernels.cu.
* `topk_gating(topk_weights [T, k] fp32, topk_indices [T, k] int32, gating_output [T, E], correction_bias [E]
  fp32, need_renorm, routed_scaling_factor, score_func="sqrtsoftplus")` (aiter/ops/topk.py; `topk_softplus` is
  its deprecated alias) fills both outputs.
* `aiter.fused_moe.fused_moe(...)` for the MXFP4 experts (A8W4, the V4 clamp): layers/moe/aiter_moe.py.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt import platform as plat
from sglang.srt.environ import envs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AiterOp:
    name: str  # short name, as the start-up line lists it
    op: str
    aiter_api: str  # the AITER function (and file) that computes this op
    used: bool
    reason: str
    calls: tuple = ()  # the `aiter` functions the wrapper calls (an older AITER may lack them: then ours runs)


AITER_OPS = (
    AiterOp("rms_norm", "RMSNorm (weighted and unweighted)", "aiter.rmsnorm2d_fwd (aiter/ops/rmsnorm.py)", True,
            "same function: fp32 math, one rounding to x's dtype; our fp32 norm weights are passed in x's dtype "
            "when that cast is exact (bf16 checkpoint weights), else AITER runs in fp32", ("rmsnorm2d_fwd",)),
    AiterOp("mhc_pre", "mHC pre (+ the sub-layer's RMSNorm when its next linear is not W8A8)",
            "aiter.mhc_pre (aiter/ops/mhc.py; csrc/kernels/mhc_kernels.cu)", True,
            "same function: fp32 mixes from (fn . x) * rsqrt(sum x^2 / (n*D) + rms_eps), pre = sigmoid + hc_eps, "
            "post = sigmoid * hc_post_mult_value (2.0), comb = softmax + eps then column / row sums + eps "
            "(sinkhorn_repeat = our iters), u rounded once to bf16; the fused norm (norm_weight, bf16) for widths "
            "7168 / 4096 / 2560 / 1280. Used for bf16 streams, hc_mult 4, hidden a multiple of 256 and >= 2048",
            ("mhc_pre",)),
    AiterOp("mhc_post", "mHC post", "aiter.mhc_post (aiter/ops/mhc.py)", True,
            "same function: post_k * o + sum_j comb[j, k] * S_j in fp32, one rounding to bf16; same conditions "
            "as mhc_pre", ("mhc_post",)),
    AiterOp("mhc_head", "mHC head", "aiter.mhc_pre with sinkhorn_repeat=0 (aiter/ops/mhc.py)", True,
            "same function: the pre weights only (sigmoid(a * scale[0] + base) + hc_eps), u rounded once to "
            "bf16; same conditions as mhc_pre", ("mhc_pre",)),
    AiterOp("router_topk", "router selection (sqrtsoftplus + bias top-k + renormalised weights)",
            "aiter.topk_gating, score_func='sqrtsoftplus' (aiter/ops/topk.py; csrc/include/"
            "topk_gating_kernels.cuh)", True,
            "same function on our logits: top-k of sqrt(softplus) + bias, weights the unbiased scores * "
            "routed_scaling_factor / max(sum, 1e-20) (ours: / (sum + 1e-20)); near-ties at the cutoff (within "
            "AITER's ~1e-6 hardware exp/log error) may pick the other expert. Score layers above "
            "router.FUSED_MAX_ROWS rows: below, our one-launch router also computes the logits GEMV",
            ("topk_gating",)),
    AiterOp("indexer_fp8", "indexer logits FP8", "fp8_mqa_logits (aiter/ops/triton/attention/fp8_mqa_logits.py), "
            "deepgemm_fp8_paged_mqa_logits (.../pa_mqa_logits.py)", False,
            "AITER not used: semantics differ (its queries are FP8; ours stay in the compute dtype) and layout "
            "differs (contiguous [start, end) key ranges or a page table; ours: per-request candidate slot lists)"),
    AiterOp("indexer_fp4", "indexer logits FP4", "aiter/ops/triton/attention/pa_mqa_logits_mxfp4.py", False,
            "AITER not used: layout differs (pages of [values | e8m0 scales] pre-shuffled in MFMA order; ours: "
            "one row per entry, codes then scales)"),
    AiterOp("moe_experts", "MoE experts (MXFP4, clamped SwiGLU)", "fused_moe (aiter/fused_moe.py: per_1x32, "
            "Silu, swiglu_limit, gate_mode='interleave'; aiter/ops/shuffle.py's interleaved layout)", True,
            "A8W4 (its MXFP8 activations; ours W4A16): gate <= limit, |up| <= limit as ours. Used per layer on "
            "gfx950 for MXFP4 experts with hidden and intermediate widths multiples of 256, bf16 / fp16 activations, "
            "no expert parallelism, when AITER_BF16_FP8_MOE_BOUND=0 (below that bound AITER takes bf16 activations "
            "through kernels its tests do not check with the clamp) and its fused_moe takes swiglu_limit and "
            "gate_mode; the experts' tensors are rewritten in place into its pre-shuffled layout at load "
            "(layers/moe/aiter_moe.py)", ("fused_moe",)),
    AiterOp("mhc_triton", "mHC (Triton variant)", "fused_mhc / mhc (aiter/ops/triton/fusions/mhc.py)", False,
            "AITER not used: semantics differ (no +hc_eps on pre, log-domain Sinkhorn without eps, mixes "
            "rounded to x's dtype; ours are fp32); the HIP aiter.mhc_pre / mhc_post above match instead"),
    AiterOp("sparse_attention", "sparse attention", "aiter/ops/triton/attention/sparse_attention_dsv4.py", False,
            "AITER not used: not evaluated yet; our Triton kernel reads our FP8 KV layout directly"),
)


def startup_line() -> str:
    """The per-op choice for the start-up log on ROCm: which ops run AITER's kernels, which ours."""
    if not aiter_wanted():
        return "aiter_ops=none (ours for every op)"
    on = [op.name for op in AITER_OPS if op.used and _available(op)]
    off = [op.name for op in AITER_OPS if op.name not in on]
    if not on:
        return "aiter_ops=none (ours for every op)"
    return f"aiter_ops=AITER: {', '.join(on)}; ours: {', '.join(off)}"


def _available(op: AiterOp) -> bool:
    if op.name == "moe_experts":  # a submodule's function, with arguments older releases lack, and a bound
        return aiter_moe_api() is not None
    return all(_api(c) is not None for c in op.calls)


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


def _api(name: str):
    """`aiter.<name>`, or None where AITER is not importable or this release lacks it."""
    module = _module()
    return getattr(module, name, None) if module is not None else None


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


# ---- mHC (aiter/ops/mhc.py: HIP kernels for hc_mult 4, bf16 residual streams, fp32 mixing weights) ------------
# Their launchers check hidden % block == 0 and hidden >= 2 * block with blocks of up to 1024 (mhc_post on gfx950),
# hence a width of at least 2048; DeepSeek-V4's widths are 4096 and 7168. The fused pre + RMSNorm kernel is built
# for these widths only (MHC_PRE_BIG_FUSE_RM_KERNEL_DISPATCH).
MHC_NORM_WIDTHS = (7168, 4096, 2560, 1280)
POST_MULT = 2.0  # post = 2 * sigmoid(...): AITER's hc_post_mult_value


def use_aiter_mhc(streams: torch.Tensor, fn: Optional[torch.Tensor] = None, api: str = "mhc_pre") -> bool:
    """Whether mHC on `streams` [T, n, D] (with mixing matrix `fn`) runs AITER's `api` (mhc_pre or mhc_post)."""
    if streams.dim() != 3 or streams.dtype != torch.bfloat16 or streams.shape[1] != 4 or streams.shape[0] == 0:
        return False  # (no rows: its launchers would size an empty grid)
    width = streams.shape[2]
    if width % 256 or width < 2048 or (fn is not None and fn.dtype != torch.float32):
        return False
    return use_aiter(streams) and _api(api) is not None


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, sinkhorn_iters: int,
            hc_eps: float, norm_eps: float, norm_weight: Optional[torch.Tensor] = None,
            norm_weight_eps: float = 0.0) -> tuple:
    """hc_pre (and, with `norm_weight` in bf16, the sub-layer's RMSNorm of u) through aiter.mhc_pre ->
    (u or norm(u) [T, D] bf16, post [T, n] fp32, comb [T, n, n] fp32). AITER's (post_mix [T, n, 1], comb_mix,
    layer_input) order and post's trailing 1 are adapted here; hc_eps is both its pre and Sinkhorn eps."""
    post, comb, u = _module().mhc_pre(streams.contiguous(), fn.contiguous(), scale.float(), base.float(),
                                      rms_eps=norm_eps, hc_pre_eps=hc_eps, hc_sinkhorn_eps=hc_eps,
                                      hc_post_mult_value=POST_MULT, sinkhorn_repeat=sinkhorn_iters,
                                      norm_weight=norm_weight, norm_eps=norm_weight_eps)
    return u, post.view(streams.shape[0], streams.shape[1]), comb


def mhc_norm_weight(streams: torch.Tensor, norm) -> Optional[torch.Tensor]:
    """The RMSNorm's weight as aiter.mhc_pre's fused norm takes it (bf16, the exact cast of ours), or None where
    the fused kernel does not apply (width not built, or the weight not exact in bf16)."""
    if streams.shape[2] not in MHC_NORM_WIDTHS or norm.weight.shape[0] != streams.shape[2]:
        return None
    if norm.weight.dtype == torch.bfloat16:
        return norm.weight
    return _weight_as(norm.weight, torch.bfloat16, norm._aiter_weights)


def mhc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hc_post through aiter.mhc_post(out, x, residual, post_layer_mix [T, n], comb_res_mix [T, n, n])."""
    new = torch.empty_like(streams, memory_format=torch.contiguous_format)
    x = out.to(streams.dtype) if out.dtype != streams.dtype else out
    _module().mhc_post(new, x if x.stride(-1) == 1 else x.contiguous(), streams.contiguous(),
                       post.float().contiguous(), comb.float().contiguous())
    return new


def mhc_head(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
             norm_eps: float) -> torch.Tensor:
    """hc_head through aiter.mhc_pre in its head mode (fn of n rows, sinkhorn_repeat 0: only the pre weights)."""
    _, _, u = _module().mhc_pre(streams.contiguous(), fn.contiguous(), scale.float(), base.float(),
                                rms_eps=norm_eps, hc_pre_eps=hc_eps, hc_sinkhorn_eps=hc_eps,
                                hc_post_mult_value=POST_MULT, sinkhorn_repeat=0)
    return u


# ---- router selection (aiter/ops/topk.py: topk_gating, the V4 sqrtsoftplus scores) ----------------------------
def use_aiter_router(x: torch.Tensor, num_experts: int, top_k: int) -> bool:
    """AITER's top-k gating on `x`'s rows: k up to one wavefront (64) and at most the expert count."""
    return top_k <= min(64, num_experts) and use_aiter(x) and _api("topk_gating") is not None


def router_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, routed_scaling_factor: float) -> tuple:
    """Scores sqrt(softplus(logits)), ids = top-k of (scores + bias), weights = the picked scores renormalised and
    scaled -> (weights [T, k] fp32, ids [T, k] int64), through aiter.topk_gating (its ids are int32)."""
    weights = torch.empty(logits.shape[0], top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(logits.shape[0], top_k, dtype=torch.int32, device=logits.device)
    _module().topk_gating(weights, ids, logits.float().contiguous(), bias.float().contiguous(), need_renorm=True,
                          routed_scaling_factor=routed_scaling_factor, score_func="sqrtsoftplus")
    return weights, ids.long()


# ---- MoE experts (aiter/fused_moe.py: fused_moe, A8W4 for MXFP4 weights; layers/moe/aiter_moe.py) ------------
@dataclass(frozen=True)
class AiterMoeApi:
    """The AITER names a call needs, resolved once."""

    fused_moe: object
    per_1x32: object  # aiter.QuantType.per_1x32
    silu: object  # aiter.ActivationType.Silu
    fp4x2: torch.dtype  # aiter.dtypes.fp4x2: the packed codes' dtype
    e8m0: torch.dtype  # aiter.dtypes.fp8_e8m0: the scale bytes' dtype


def aiter_moe_api() -> Optional[AiterMoeApi]:
    """AITER's fused MoE where it serves MXFP4 experts with the clamp (layers/moe/aiter_moe.py), else None: ROCm gfx950,
    AITER wanted and importable, a fused_moe taking swiglu_limit and gate_mode, and AITER_BF16_FP8_MOE_BOUND=0."""
    if plat.gfx_arch() != "gfx950" or not aiter_wanted() or envs.AITER_BF16_FP8_MOE_BOUND.get() != 0:
        return None
    aiter = _module()
    try:
        fused = importlib.import_module("aiter.fused_moe").fused_moe if aiter is not None else None
        params = inspect.signature(fused).parameters if fused is not None else {}
        api = AiterMoeApi(fused, aiter.QuantType.per_1x32, aiter.ActivationType.Silu, aiter.dtypes.fp4x2,
                          aiter.dtypes.fp8_e8m0)
    except (ImportError, AttributeError, TypeError, ValueError):  # an older AITER without these names
        return None
    return api if "swiglu_limit" in params and "gate_mode" in params else None
