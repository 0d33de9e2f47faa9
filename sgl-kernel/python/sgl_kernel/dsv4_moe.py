"""dsv4_moe_mxfp4 / dsv4_moe_fp8 / dsv4_moe_dense: DeepSeek-V4's routed experts from packed MXFP4 weights (W4A16),
FP8-converted ones (W8A16: e4m3 with 128x128 block multipliers) or unquantized bf16 / fp16 / fp32 weights (where torch
has no grouped GEMM for them); the one module the engine imports for them.

The MoE runs in device steps: the (token, slot) pairs sorted by expert into blocks (dsv4_moe_align), the gate-up with
the clamped SwiGLU silu(min(g, L)) * clamp(u, -L, L), the down times the router weights, and each token's k rows
summed in slot order (dsv4_moe_sums.combine_pairs: deterministic). No host read: graph-capturable. This module picks
the kernels per call, from static facts only (a CUDA graph captures one choice per batch size):
- 1-8 tokens with `gemv=True` and no `config`, 16-bit activations on an NVIDIA GPU (or the interpreter), a finite
  limit and widths the tiles divide: CUDA-core GEMVs straight from the router's ids, no sort (dsv4_moe_gemv);
- decode blocks (up to 16 pairs per expert) with bf16 activations on an NVIDIA GPU and scale bytes the caller checked
  at load (`scales_fit_planes`, see `scale_bytes_fit_planes`): the parity planes (dsv4_moe_planes), where their
  tiles divide the widths;
- otherwise the general kernels (dsv4_moe_general): tl.dot_scaled for bf16 / fp16 activations with MXFP4 weights
  where the caller allows it (`scaled_dot`: not on gfx942, which has no MXFP4 MFMA), the in-register dequantization
  for fp32 activations (GPU oracle runs), for FP8 experts and where the scaled dot is not taken;
- unquantized weights: the dense-weight kernels (dsv4_moe_dense), the general kernels' blocks with the weight tiles
  loaded as they are.
`moe_config` holds each path's launches by pairs per expert; `config=` overrides them (tests, sweeps). The types the
paths share (MoeLaunch, MoeConfig) live in dsv4_moe_common, so no path imports this module back. Scale bytes come
row-major (the checkpoint's [E, rows, groups]) or chunked (dsv4_mxfp4_scales: the experts module's storage,
re-exported here). The torch references are dsv4_moe_ref.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from sgl_kernel.dsv4_moe_align import dsv4_moe_align
from sgl_kernel.dsv4_moe_common import FP4_BLOCK, MoeConfig, MoeLaunch
from sgl_kernel.dsv4_moe_dense import dense_config, dense_down, dense_gate_up
from sgl_kernel.dsv4_moe_gemv import GEMV_MAX_TOKENS, gemv_fits, gemv_launch, gemv_moe, gemv_supported
from sgl_kernel.dsv4_moe_general import dequant_shared_bytes, general_down, general_gate_up, tma_supported
from sgl_kernel.dsv4_moe_planes import SCALE_MAX, SCALE_MIN, planes_down, planes_fit, planes_gate_up, planes_supported
from sgl_kernel.dsv4_moe_sums import combine_pairs
from sgl_kernel.dsv4_mxfp4_scales import CHUNK, as_rows, chunked_empty, scale_groups
from sgl_kernel.dsv4_pdl import pdl_supported
from sgl_kernel.dsv4_target import lds_limit, nvidia_arch, shared_memory_limit

__all__ = [
    "CHUNK", "SCALE_MAX", "SCALE_MIN", "MoeConfig", "MoeLaunch", "as_rows", "chunked_empty", "dense_config",
    "describe_fp8", "describe_mxfp4", "dsv4_moe_dense", "dsv4_moe_fp8", "dsv4_moe_mxfp4", "fit_shared_memory",
    "moe_config", "moe_down",
    "moe_gate_up", "mxfp4_experts_of", "planes_supported", "scale_bytes_fit_planes", "tma_supported",
]

# Decode launches of the parity planes (`planes`: bf16 activations on NVIDIA GPUs, scale bytes within the planes'
# exact range), the best of the H200 sweeps: from 6 tokens (Flash) 256-wide K tiles, 3 stages, the gate-up with 2
# warps and the planes first in the MMA (172.2 / 512.5 us at 8 / 32 tokens), the down 128 wide with 4 warps (79.2 /
# 269.6 us; RESULTS.md, "MoE decode: lean parity-plane kernels, planes first in the MMA", 2026-12-04). Fewer tokens
# split over K (more programs, each with a shorter K loop; RESULTS.md, "MoE decode: K splits for one token, chained
# launches (PDL), the read floor of a decode MoE", 2026-12-04): one token's gate-up 128 x 128 tiles in 4 splits (27.6
# us against 32.4 unsplit at 128 x 256), its down 128 x 256 in 2 (13.1 against 13.9 us at 64 x 256); 2-5 tokens'
# gate-up 128 x 256 in 2 (47.3 / 97.8 us at 2 / 5 tokens against 54.5 / 102.3 unsplit), their down PLANES_DOWN (23.4 /
# 50.3 us against 25.2 / 54.2 split in 2). With the GEMVs taking 1-8 tokens by default, the planes' launches for
# them run only where the GEMVs do not (SGLANG_DSV4_MOE_DECODE=planes, widths the GEMV tiles do not divide).
PLANES_GATE_UP_ONE = MoeLaunch(128, 128, 4, 3, scaled_dot=False, split_k=4, planes=True)
PLANES_DOWN_ONE = MoeLaunch(128, 256, 4, 3, scaled_dot=False, split_k=2, planes=True)
PLANES_GATE_UP_FEW = MoeLaunch(128, 256, 4, 3, scaled_dot=False, split_k=2, planes=True)
PLANES_GATE_UP = MoeLaunch(64, 256, 2, 3, scaled_dot=False, planes=True, swap=True)
PLANES_DOWN = MoeLaunch(128, 256, 4, 3, scaled_dot=False, planes=True)


def moe_config(num_pairs: int, num_experts: int, scaled_dot: bool = True, fp8: bool = False,
               tma: bool = False, planes: bool = False, lds: Optional[int] = None) -> MoeConfig:
    """Launch settings by pairs per expert (static for a batch size: graph capture sees one) and path (tl.dot_scaled
    for 16-bit activations with MXFP4 weights, else in-register dequantization); `tma`: the device has TMA tensor
    descriptors (`tma_supported`). From the H200 sweeps (benchmark/kernels/sweep_moe_mxfp4.py, Flash widths;
    RESULTS.md "Fused MXFP4 MoE on an H200" and later): decode (<= 16 pairs per expert) 16-row blocks with long K
    tiles; prefill 128-row blocks (64 up to 64 pairs per expert). The scaled dot beat the in-register path 1.2-4.6x
    per kernel (swapping its operands, weights as the MMA's first one, never won and was dropped; so did K splits,
    1-8-row multiply-adds and one MMA per 32-input scale group with the multiplier on the fp32 partial: 2026-12-02;
    the next K tile prefetched into registers before the current tile's MMAs, 1.2-1.5x slower: 2026-12-03; and 8
    warps: 2026-12-04). Decode, timed as CUDA-graph replays: one token's few experts want 256-wide K tiles
    unpipelined, gate-up's codes by pointers (its TMA copies were 1.2x slower), down's through TMA (19.2 us against
    27.1 for 3-stage 128-wide tiles); from 8 tokens 3-stage 128-wide K tiles with the codes through TMA (5-12% faster
    than pointer loads at 8 and 32 tokens: RESULTS.md, "TMA copies in the MoE's decode launches; an FP8 GEMM that
    quantizes its own activations loses", 2026-12-03). `planes` (the caller's bf16 activations and checked scales on
    an NVIDIA GPU: planes_supported): decode takes the parity planes' launches (PLANES_GATE_UP[_ONE / _FEW],
    PLANES_DOWN[_ONE]). `lds`: a ROCm device's LDS bytes (dsv4_target.lds_limit): the in-register dequantization
    takes `hip_dequant_config`'s tiles there."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 64 if per_expert <= 64 else 128
    if lds is not None and not scaled_dot:
        return hip_dequant_config(block_m, lds)
    if planes and block_m == 16:
        if num_pairs * 32 <= num_experts:  # one token's experts (Flash: 6 of 256): wide tiles, K splits
            return MoeConfig(16, PLANES_GATE_UP_ONE, PLANES_DOWN_ONE)
        if num_pairs * 8 <= num_experts:  # a few tokens' (Flash: 2-5)
            return MoeConfig(16, PLANES_GATE_UP_FEW, PLANES_DOWN)
        return MoeConfig(16, PLANES_GATE_UP, PLANES_DOWN)
    if scaled_dot:
        if block_m == 16 and num_pairs * 8 <= num_experts:
            return MoeConfig(16, MoeLaunch(64, 256, 4, 1), MoeLaunch(64, 256, 4, 1, tma=tma))
        if block_m == 16 and tma:
            return MoeConfig(16, MoeLaunch(64, 128, 4, 3, tma=True), MoeLaunch(128, 128, 4, 3, tma=True))
        if block_m == 16:
            return MoeConfig(16, MoeLaunch(64, 128, 4, 1), MoeLaunch(64, 128, 4, 1))
        return MoeConfig(block_m, MoeLaunch(64, 64, 4, 3), MoeLaunch(128, 64, 4, 3))
    if block_m == 16:
        return MoeConfig(16, MoeLaunch(32, 256, 4, 3, scaled_dot=False), MoeLaunch(64, 256, 4, 1, scaled_dot=False))
    # FP8 weight tiles need narrower gate-up tiles: 128 x 128 with 128-row blocks wants 256 KB of shared memory
    gate_up = MoeLaunch(64, 128, 4, 2, scaled_dot=False) if fp8 else MoeLaunch(128, 128, 8, 2, scaled_dot=False)
    return MoeConfig(block_m, gate_up, MoeLaunch(128, 64, 4, 3, scaled_dot=False))


# The in-register dequantization's tiles on ROCm. NVIDIA's (above) were sized for 227 KiB of shared memory; Triton's
# AMD pipeliner keeps the dequantized weight tiles (two for gate-up) and the activation tile in LDS, which at those
# tiles took 98-270 KiB (python -m sgl_kernel.aot_check), over gfx942's 64 KiB and gfx950's 160 KiB. Two stages (the
# AMD backend's usual) and 64-wide K tiles fit both (gfx942 with half-width N tiles) at fp32 activations too.
HIP_LARGE_LDS = 128 * 1024


def hip_dequant_config(block_m: int, lds: int) -> MoeConfig:
    """MoeConfig of the in-register dequantization (FP8 experts, MXFP4 with fp32 activations) on a ROCm device with
    `lds` bytes of LDS a workgroup."""
    wide = lds >= HIP_LARGE_LDS
    if block_m == 16:
        return MoeConfig(16, MoeLaunch(32, 128, 4, 2, scaled_dot=False), MoeLaunch(64, 128, 4, 2, scaled_dot=False))
    return MoeConfig(block_m, MoeLaunch(64 if wide else 32, 64, 4, 2, scaled_dot=False),
                     MoeLaunch(128 if wide else 64, 64, 4, 2, scaled_dot=False))


def fit_shared_memory(cfg: MoeConfig, act_bytes: int, fp8: bool, scaled: bool, limit: Optional[int],
                      arch: Optional[int] = None) -> MoeConfig:
    """`cfg` with each in-register dequantization launch (FP8 experts, fp32 activations: not `scaled`, or a launch
    without scaled_dot) at the most stages, up to its own, whose shared memory (dequant_shared_bytes at `act_bytes`
    activations) fits `limit` bytes, an NVIDIA GPU's (dsv4_target.shared_memory_limit; None: unchanged). The NVIDIA
    tiles were measured with bf16 activations: FP8 experts' decode gate-up with fp32 activations (the oracle path)
    takes 256 KiB at its 3 stages, past the H100's 227 KiB, and runs at 2 (160 KiB). `arch`: the NVIDIA GPU's compute
    capability x10 (dsv4_target.nvidia_arch): on sm100 FP8 experts' prefill gate-up with fp32 activations takes
    272 KiB at its 2 stages and runs at 1 (128 KiB)."""
    if limit is None:
        return cfg

    def fit(launch: MoeLaunch, weight_tiles: int) -> MoeLaunch:
        if launch.planes or (scaled and launch.scaled_dot):
            return launch
        while launch.num_stages > 1 and dequant_shared_bytes(cfg.block_m, launch, act_bytes, fp8, weight_tiles,
                                                                   arch) > limit:
            launch = dataclasses.replace(launch, num_stages=launch.num_stages - 1)
        return launch

    return dataclasses.replace(cfg, gate_up=fit(cfg.gate_up, 2), down=fit(cfg.down, 1))


def scale_bytes_fit_planes(smallest: int, largest: int) -> bool:
    """Whether scale bytes from `smallest` to `largest` (the range a caller read at load) lie within the parity
    planes' exact range [SCALE_MIN, SCALE_MAX], so it may pass scales_fit_planes=True; an empty range (smallest >
    largest: nothing loaded) fits nothing."""
    return SCALE_MIN <= smallest <= largest <= SCALE_MAX


def dsv4_moe_mxfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                   w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                   config: Optional[MoeConfig] = None, scales_fit_planes: bool = False,
                   gemv: bool = False, add: Optional[torch.Tensor] = None,
                   scaled_dot: bool = True) -> torch.Tensor:
    """x [T, D] (bf16/fp16/fp32), topk_ids / topk_weights [T, k] (ids -1: another rank's expert, adds nothing), w13
    uint8 [E, 2I, D/2] + w13_scale uint8 [E, 2I, D/32], w2 uint8 [E, D, I/2] + w2_scale uint8 [E, D, I/32] -> [T, D]
    in x's dtype. The scale bytes may also come chunked ([E, rows, groups / 8, 8] views: dsv4_mxfp4_scales, the
    experts module's storage on the GPU). scales_fit_planes: every scale byte is within the parity planes' exact range
    (checked by the caller at load: scale_bytes_fit_planes), so decode launches may take the PTX planes where the
    device has them. gemv: up to 8 tokens take the CUDA-core GEMVs where the device, dtype, widths and a finite limit
    allow (no `config` given). add: [T, D] rows in x's dtype (the shared expert's output) added to the result by the
    MoE's last kernel, as torch's `result + add` adds them (dsv4_moe_sums.add_rounded). scaled_dot False: the general
    kernels dequantize the codes in registers even for 16-bit activations (gfx942)."""
    inter, (w13b, s13, w2b, s2) = mxfp4_experts_of(x, w13, w13_scale, w2, w2_scale)
    tokens = x.shape[0]
    if (gemv and config is None and 0 < tokens <= GEMV_MAX_TOKENS and gemv_supported(x.device, x.dtype)
            and 0 < limit < math.inf and gemv_fits(gemv_launch(tokens), x.shape[1], inter)):
        return gemv_moe(x, topk_ids, topk_weights, w13b, s13, w2b, s2, limit, inter, add=add)
    return _fused_moe(x, topk_ids, topk_weights, w13b, s13, w2b, s2, limit, inter, fp8=False, config=config,
                      planes=scales_fit_planes and planes_supported(x.device, x.dtype), add=add,
                      scaled_dot=scaled_dot)


def describe_mxfp4(device: torch.device, dtype: torch.dtype, hidden: int, inter: int, limit: float,
                   scales_fit_planes: bool = False, gemv: bool = False, scaled_dot: bool = True) -> str:
    """In words, the kernels dsv4_moe_mxfp4 (same arguments, no `config`) picks for these experts by batch size, from
    the predicates it asks per call (a start-up log line)."""
    parts = []
    if gemv and gemv_supported(device, dtype) and 0 < limit < math.inf:
        tokens = [t for t in range(1, GEMV_MAX_TOKENS + 1) if gemv_fits(gemv_launch(t), hidden, inter)]
        if tokens:
            spans = f"{tokens[0]}-{tokens[-1]}" if tokens == list(range(tokens[0], tokens[-1] + 1)) else \
                ", ".join(map(str, tokens))
            parts.append(f"CUDA-core GEMVs at {spans} tokens")
    if (scales_fit_planes and planes_supported(device, dtype) and planes_fit(PLANES_GATE_UP, hidden, inter)
            and planes_fit(PLANES_DOWN, inter, hidden)):
        parts.append(f"PTX parity planes for {'other ' if parts else ''}decode batches")
    scaled = scaled_dot and dtype in (torch.bfloat16, torch.float16)
    general = "tl.dot_scaled" if scaled else "in-register dequantization"
    return ", ".join(parts + [f"general kernels ({general}) {'above' if parts else 'at every batch size'}"])


def describe_fp8() -> str:
    """In words, the kernels dsv4_moe_fp8 runs (a start-up log line)."""
    return "W8A16, general kernels with the FP8 tiles converted in registers at every batch size"


def mxfp4_experts_of(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                     w2_scale: torch.Tensor) -> tuple:
    """(intermediate size, the four tensors as uint8) after checking that they fit x (dsv4_moe_mxfp4's layouts)."""
    hidden = x.shape[1]
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    inter = two_inter // 2
    if (w13.shape[2] * 2 != hidden or w2.shape != (num_experts, hidden, inter // 2) or hidden % FP4_BLOCK
            or inter % FP4_BLOCK or scale_groups(w13_scale) != (num_experts, two_inter, hidden // FP4_BLOCK)
            or scale_groups(w2_scale) != (num_experts, hidden, inter // FP4_BLOCK) or x.stride(1) != 1):
        raise ValueError(f"MXFP4 experts w13 {tuple(w13.shape)} / {tuple(w13_scale.shape)}, w2 {tuple(w2.shape)} / "
                         f"{tuple(w2_scale.shape)} do not fit x {tuple(x.shape)}")
    return inter, tuple(t.view(torch.uint8) for t in (w13, w13_scale, w2, w2_scale))


def dsv4_moe_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                 w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                 config: Optional[MoeConfig] = None, add: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FP8-converted experts (e4m3 with fp32 multipliers per 128x128 block of each projection), W8A16, on the general
    kernels: w13 e4m3 [E, 2I, D] (w1 rows, then w3 rows), w13_scale fp32 [E, 2, ceil(I/128), ceil(D/128)] (w1's
    grid, w3's grid), w2 e4m3 [E, D, I], w2_scale fp32 [E, 1, ceil(D/128), ceil(I/128)] -> [T, D] in x's dtype
    (plus `add` as dsv4_moe_mxfp4's)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    nb = lambda n: -(-n // 128)  # noqa: E731
    if (w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter) or x.stride(1) != 1
            or w13_scale.shape != (num_experts, 2, nb(inter), nb(hidden))
            or w2_scale.shape != (num_experts, 1, nb(hidden), nb(inter))):
        raise ValueError(f"FP8 experts w13 {tuple(w13.shape)} / {tuple(w13_scale.shape)}, w2 {tuple(w2.shape)} / "
                         f"{tuple(w2_scale.shape)} do not fit x {tuple(x.shape)}")
    return _fused_moe(x, topk_ids, topk_weights, w13, w13_scale.float(), w2, w2_scale.float(), limit, inter, fp8=True,
                      config=config, add=add)


def dsv4_moe_dense(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
                   w3: torch.Tensor, w2: torch.Tensor, limit: float,
                   config: Optional[MoeConfig] = None, add: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Unquantized experts in x's dtype (bf16 / fp16 / fp32), fp32 accumulation: x [T, D], topk_ids / topk_weights
    [T, k] (ids -1: another rank's expert, adds nothing), w1 / w3 [E, I, D] (gate, up), w2 [E, D, I] -> [T, D] in x's
    dtype, any strides (a merged w13 [E, 2I, D] passes as w13[:, :I], w13[:, I:]). `config` overrides dense_config's
    launches (tests, sweeps); a launch's scaled_dot / tma / planes settings do not apply to these weights. `add`: as
    dsv4_moe_mxfp4's."""
    num_tokens, hidden = x.shape
    num_experts, inter = w1.shape[0], w1.shape[1]
    if (w1.dim() != 3 or w3.shape != w1.shape or w1.shape[2] != hidden or w2.shape != (num_experts, hidden, inter)
            or topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens
            or x.stride(1) != 1):
        raise ValueError(f"dense experts w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} with "
                         f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} do not fit x "
                         f"{tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or any(w.dtype != x.dtype for w in (w1, w3, w2)):
        raise ValueError(f"dense experts take bf16 / fp16 / fp32 weights in x's dtype, got x {x.dtype} and weights "
                         f"{w1.dtype} / {w3.dtype} / {w2.dtype}")
    if num_tokens == 0:
        return torch.zeros_like(x)
    top_k = topk_ids.shape[1]
    cfg = config or dense_config(num_tokens * top_k, num_experts, x.dtype)
    rows, block_expert = dsv4_moe_align(topk_ids, num_experts, cfg.block_m)
    h = dense_gate_up(x, rows, block_expert, w1, w3, top_k, limit, cfg.block_m, cfg.gate_up)
    pairs = dense_down(h, rows, block_expert, w2, topk_weights.flatten().float().contiguous(), cfg.block_m, cfg.down)
    return combine_pairs(pairs, top_k, x.dtype, add=add)


def _fused_moe(x, topk_ids, topk_weights, w13, s13, w2, s2, limit: float, inter: int, fp8: bool,
               config: Optional[MoeConfig] = None, planes: bool = False,
               add: Optional[torch.Tensor] = None, scaled_dot: bool = True) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    scaled = scaled_dot and not fp8 and x.dtype in (torch.bfloat16, torch.float16)
    pick = lambda planes: moe_config(num_tokens * top_k, num_experts, scaled_dot=scaled, fp8=fp8,  # noqa: E731
                                     tma=tma_supported(x.device), planes=planes, lds=lds_limit(x.device))
    cfg = config or pick(planes)
    if config is None and cfg.gate_up.planes and not (planes_fit(cfg.gate_up, hidden, inter)
                                                      and planes_fit(cfg.down, inter, hidden)):
        cfg = pick(False)  # widths the planes' tiles do not divide (small test models): the scaled dot
    if config is None:
        cfg = fit_shared_memory(cfg, x.element_size(), fp8, scaled, shared_memory_limit(x.device),
                                nvidia_arch(x.device))
    pdl = cfg.pdl and cfg.gate_up.planes and cfg.down.planes and pdl_supported(x.device)
    rows, block_expert = dsv4_moe_align(topk_ids, num_experts, cfg.block_m, pdl=pdl)
    h = moe_gate_up(x, rows, block_expert, w13, s13, inter, top_k, limit, cfg.block_m, cfg.gate_up, fp8, pdl)
    pairs = moe_down(h, rows, block_expert, w2, s2, topk_weights, hidden, cfg.block_m, cfg.down, fp8, pdl)
    return combine_pairs(pairs, top_k, x.dtype, pdl, add)


def moe_gate_up(x, rows, block_expert, w13, s13, inter: int, top_k: int, limit: float, block_m: int,
                launch: MoeLaunch, fp8: bool, pdl: bool = False) -> torch.Tensor:
    """Step 2 alone (the benchmark sweeps time it) on the launch's path: the activated intermediate rows
    [num_blocks * block_m, I]. pdl (planes launches only): launched as programmatic dependents (dsv4_pdl)."""
    if not launch.planes:
        return general_gate_up(x, rows, block_expert, w13, s13, inter, top_k, limit, block_m, launch, fp8)
    if fp8:
        raise ValueError("MoeLaunch.planes takes MXFP4 weights, not FP8 experts")
    return planes_gate_up(x, rows, block_expert, w13, s13, inter, top_k, limit, block_m, launch, pdl)


def moe_down(h, rows, block_expert, w2, s2, topk_weights, hidden: int, block_m: int, launch: MoeLaunch,
             fp8: bool, pdl: bool = False) -> torch.Tensor:
    """Step 3 alone on the launch's path: each (token, slot) pair's weighted expert output [T * k, D] fp32; a planes
    launch split over K gives one such slice per split, [splits, T * k, D] (combine_pairs adds them)."""
    weights = topk_weights.flatten().float().contiguous()
    if not launch.planes:
        return general_down(h, rows, block_expert, w2, s2, weights, hidden, block_m, launch, fp8)
    if fp8:
        raise ValueError("MoeLaunch.planes takes MXFP4 weights, not FP8 experts")
    return planes_down(h, rows, block_expert, w2, s2, weights, hidden, block_m, launch, pdl)
