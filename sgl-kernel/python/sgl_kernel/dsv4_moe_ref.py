"""Torch references of the fused MoE (dsv4_moe.py) and its expert sort (dsv4_moe_align.py, `align_ref`): routed
experts stored as the hub's MXFP4 (e2m1 codes packed two per byte, low nibble = even input; one ue8m0 exponent byte
per 32 inputs of a row; `fused_moe_mxfp4_ref`), FP8-converted (`fused_moe_fp8_ref`) or unquantized
(`fused_moe_dense_ref`), computed W4A16 / W8A16 / in fp32: each weight dequantized exactly (code value * 2^(byte -
127), or e4m3 * block multiplier), the clamped SwiGLU between the projections, the router weights applied, each
token's k expert outputs summed.

Layouts (what the engine keeps on the GPU): w13 [E, 2I, D/2] uint8 (rows 0..I-1 the gate projection w1, I..2I-1 the
up projection w3), w13_scale [E, 2I, D/32] uint8; w2 [E, D, I/2], w2_scale [E, D, I/32].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_kernel.dsv4_formats_ref import FP4_BLOCK, e2m1_values


def dequant_mxfp4_ref(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] codes + uint8 [..., N, K/32] exponent bytes -> fp32 [..., N, K]."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    mult = torch.ldexp(torch.ones(scale.shape, device=scale.device), scale.view(torch.uint8).to(torch.int32) - 127)
    return e2m1_values(codes) * mult.repeat_interleave(FP4_BLOCK, dim=-1)


def align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple:
    """The block layout of dsv4_moe_align, in plain Python: (pair index per padded row, -1 padding; expert per block,
    num_experts for the blocks of pairs whose id is -1 (another rank's expert), after every real expert's)."""
    pairs = [num_experts if x < 0 else x for x in topk_ids.flatten().tolist()]
    rows, experts = [], []
    for e in range(num_experts + 1):
        mine = [p for p, x in enumerate(pairs) if x == e]
        for start in range(0, len(mine), block_m):
            chunk = mine[start:start + block_m]
            rows += chunk + [-1] * (block_m - len(chunk))
            experts.append(e)
    return rows, experts


def _moe_ref(x, topk_ids, topk_weights, expert_weights, limit: float) -> torch.Tensor:
    """sum_j w_j * w2_e . swiglu_L(w1_e x, w3_e x) with `expert_weights(e)` -> fp32 (w1, w3, w2) of expert e; pairs
    with e = -1 (another rank's expert) add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in [e for e in topk_ids.unique().tolist() if e >= 0]:
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w1, w3, w2 = expert_weights(e)
        xt = x[tok].float()
        act = F.silu((xt @ w1.T).clamp(max=limit)) * (xt @ w3.T).clamp(min=-limit, max=limit)
        out.index_add_(0, tok, (act @ w2.T) * topk_weights[tok, slot, None].float())
    return out


def fused_moe_mxfp4_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                        w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                        limit: float) -> torch.Tensor:
    """x [T, D], topk_ids / topk_weights [T, k] -> [T, D] fp32, from MXFP4 experts (layouts above; scale bytes also
    as dsv4_mxfp4_scales' chunked [E, rows, groups / 8, 8] views)."""
    inter = w13.shape[1] // 2
    w13_scale, w2_scale = (s.reshape(s.shape[0], s.shape[1], -1) for s in (w13_scale, w2_scale))  # row-major bytes

    def weights(e):
        w13e = dequant_mxfp4_ref(w13[e], w13_scale[e])
        return w13e[:inter], w13e[inter:], dequant_mxfp4_ref(w2[e], w2_scale[e])

    return _moe_ref(x, topk_ids, topk_weights, weights, limit)


def _dequant_fp8_grid(w: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] times fp32 multipliers [ceil(N/128), ceil(K/128)] -> fp32 [N, K]."""
    n, k = w.shape
    return w.float() * grid.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def fused_moe_fp8_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                      limit: float) -> torch.Tensor:
    """The same function for FP8-converted experts (layouts in dsv4_moe.dsv4_moe_fp8)."""
    inter = w13.shape[1] // 2

    def weights(e):
        return (_dequant_fp8_grid(w13[e, :inter], w13_scale[e, 0]), _dequant_fp8_grid(w13[e, inter:], w13_scale[e, 1]),
                _dequant_fp8_grid(w2[e], w2_scale[e, 0]))

    return _moe_ref(x, topk_ids, topk_weights, weights, limit)


def fused_moe_dense_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
                        w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """The same function for unquantized experts (layouts in dsv4_moe.dsv4_moe_dense), one expert at a time in
    fp32."""
    return _moe_ref(x, topk_ids, topk_weights, lambda e: (w1[e].float(), w3[e].float(), w2[e].float()), limit)
