"""AITER's fused MoE (aiter.fused_moe.fused_moe) for packed MXFP4 routed experts on MI355X (gfx950): A8W4.

What AITER offers for MXFP4 weights with DeepSeek-V4's clamped SwiGLU (read from ROCm/aiter, August 2026:
aiter/fused_moe.py, aiter/ops/shuffle.py, op_tests/test_moe_2stage.py; not run, no AMD GPU here):
`fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, activation=ActivationType.Silu,
quant_type=QuantType.per_1x32, w1_scale=..., w2_scale=..., swiglu_limit=L, gate_mode="interleave")` with bf16 / fp16
activations runs its FlyDSL A8W4 kernels on gfx950: the activations quantized to MXFP8 in its sort, the gate-up
computed from w1 = [gate rows | up rows] [E, 2I, D/2] (gate <= L, |up| <= L, silu(gate) * up), the down weighted by
topk_weight. Its own tests pass swiglu_limit only to the A16W4 / A8W4 kernels; with gate_mode "separated" (or below
AITER_BF16_FP8_MOE_BOUND rows, where it takes bf16 activations) other kernels may run, which its tests do not check
with the clamp. So a layer is served by AITER only where every batch takes A8W4: AITER_BF16_FP8_MOE_BOUND=0, the
setting upstream's MI355X recipes use.

The weights it reads are pre-shuffled for its kernels (`layout` below): w1's codes in 16-row x 64-byte tiles with the
gate and up rows of one 16-row block side by side, w2's in the same tiles without the gate / up pairing; the e8m0
scale bytes in 32-row x 8-group tiles ordered for its lanes. `to_aiter_layout` rewrites a Mxfp4RoutedExperts' tensors
in place (one expert at a time: no second copy of the layer), after which only AITER reads them (our Triton kernels
read the checkpoint's order); `load_expert` keeps writing them through the same permutation. The activations differ
from our W4A16 kernels (MXFP8 inputs: one rounding of x and of the SwiGLU output to e4m3 with a shared exponent per 32).
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.layers.aiter_ops import AiterMoeApi

logger = logging.getLogger(__name__)

WIDTH_MULTIPLE = 256  # hidden and intermediate widths: whole scale tiles (8 groups of 32) and 256-wide N tiles
GATE_MODE = "interleave"  # aiter GateMode.INTERLEAVE: its A8W4 kernels (gate and up rows paired per 16-row block)


def widths_supported(hidden: int, intermediate: int) -> bool:
    return hidden % WIDTH_MULTIPLE == 0 and intermediate % WIDTH_MULTIPLE == 0


# ---- the layout (aiter/ops/shuffle.py's shuffle_weight / shuffle_scale with is_guinterleave=True) ---------------
# Codes [rows, K/2 bytes] of one expert: row r = 16 * b + lane of 16-row block b, byte c = 64 * t + 16 * q + j of
# 64-byte tile t (q: one of the 4 lanes sharing a row, j: the 16 bytes each loads). AITER stores, per block b, its
# tiles t in order, each as (q, lane, j). For w1, block b of the gate rows and block b of the up rows are stored
# one after the other (gate first) before block b + 1. Scale bytes [rows, G] (G groups of 32 inputs), group
# g = 8 * t + 4 * h + q, rows in blocks b: for w1 row 16 * b + lane of the gate (p = 0) or up (p = 1) rows, for w2
# row 32 * b + 16 * p + lane; stored per block b, tile t as (q, lane, h, p).
def _code_dims(rows: int, row_bytes: int, gate_up: bool) -> tuple:
    """The codes of one expert seen as (half, block, lane, tile, q, j) and the order AITER stores those axes in."""
    half = 2 if gate_up else 1
    return (half, rows // half // 16, 16, row_bytes // 64, 4, 16), (1, 0, 3, 4, 2, 5)


def _scale_dims(rows: int, groups: int, gate_up: bool) -> tuple:
    """Scale bytes of one expert seen as axes, and AITER's order of them (see above)."""
    if gate_up:  # (p = gate / up, block, lane, tile, h, q)
        return (2, rows // 32, 16, groups // 8, 2, 4), (1, 3, 5, 2, 4, 0)
    return (rows // 32, 2, 16, groups // 8, 2, 4), (0, 3, 5, 2, 4, 1)  # (block, p, lane, tile, h, q)


def _permute(x: torch.Tensor, dims: tuple, order: tuple, inverse: bool) -> torch.Tensor:
    """x (one expert's rows) rearranged into AITER's order, or back from it."""
    if not inverse:
        return x.reshape(dims).permute(order).reshape(x.shape)
    stored = tuple(dims[i] for i in order)
    back = tuple(order.index(i) for i in range(len(order)))
    return x.reshape(stored).permute(back).reshape(x.shape)


def shuffle_codes(w: torch.Tensor, gate_up: bool, inverse: bool = False) -> torch.Tensor:
    """One expert's packed codes [rows, K/2] in (or, `inverse`, out of) AITER's layout."""
    dims, order = _code_dims(w.shape[0], w.shape[1], gate_up)
    return _permute(w, dims, order, inverse)


def shuffle_scales(s: torch.Tensor, gate_up: bool, inverse: bool = False) -> torch.Tensor:
    """One expert's scale bytes [rows, G] in (or out of) AITER's layout."""
    dims, order = _scale_dims(s.shape[0], s.shape[1], gate_up)
    return _permute(s, dims, order, inverse)


def to_aiter_layout(experts) -> None:
    """Rewrite a Mxfp4RoutedExperts' codes and scale bytes in place into AITER's layout, one expert at a time; the
    scale parameters become row-major [E, rows, G] over the same storage."""
    from sgl_kernel.dsv4_moe import as_rows

    with torch.no_grad():
        for name, gate_up in (("w13", True), ("w2", False)):
            codes, scale = getattr(experts, name), getattr(experts, name + "_scale")
            e, rows = codes.shape[0], codes.shape[1]
            groups = codes.shape[2] * 2 // 32
            flat = scale.data.view(e, rows * groups)  # chunked or row-major storage: one block of bytes per expert
            for i in range(e):
                codes.data[i].copy_(shuffle_codes(codes.data[i].clone(), gate_up))
                plain = as_rows(scale.data)[i].reshape(rows, groups) if scale.dim() == 4 else scale.data[i]
                flat[i].copy_(shuffle_scales(plain.clone(), gate_up).flatten())
            setattr(experts, name + "_scale", torch.nn.Parameter(flat.view(e, rows, groups), requires_grad=False))


def write_expert_rows(target_codes: torch.Tensor, part: torch.Tensor, first_row: int, gate_up: bool,
                      scales: bool) -> None:
    """Write `part` (checkpoint rows from `first_row` of one expert: codes or scale bytes) into that expert's tensor
    `target_codes`, kept in AITER's layout."""
    shuffle = shuffle_scales if scales else shuffle_codes
    plain = shuffle(target_codes, gate_up, inverse=True).clone()
    plain[first_row:first_row + part.shape[0]] = part
    target_codes.copy_(shuffle(plain, gate_up))


def fused_experts(api: AiterMoeApi, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                  limit: float) -> torch.Tensor:
    """The routed experts' sum through AITER: x [T, D] bf16 / fp16, ids / weights [T, k] (the weights carry the
    routed scaling: the router applied it), tensors in AITER's layout -> [T, D] in x's dtype."""
    w1, w2v = w13.view(api.fp4x2), w2.view(api.fp4x2)
    w1.is_shuffled = w2v.is_shuffled = True  # what selects its pre-shuffled (FlyDSL) kernels
    e, rows = w13.shape[0], w13.shape[1]
    return api.fused_moe(x.contiguous(), w1, w2v, topk_weights.float().contiguous(),
                         topk_ids.to(torch.int32).contiguous(), activation=api.silu, quant_type=api.per_1x32,
                         w1_scale=w13_scale.view(api.e8m0).view(e * rows, -1),
                         w2_scale=w2_scale.view(api.e8m0).view(e * w2.shape[1], -1),
                         swiglu_limit=float(limit), gate_mode=GATE_MODE)

