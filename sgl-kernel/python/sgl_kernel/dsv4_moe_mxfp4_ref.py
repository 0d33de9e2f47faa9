"""Torch references of the fused MXFP4 MoE (dsv4_moe_mxfp4.py): routed experts stored as the hub's MXFP4 (e2m1
codes packed two per byte, low nibble = even input; one ue8m0 exponent byte per 32 inputs of a row), computed
W4A16: each weight dequantized exactly (code value * 2^(byte - 127)), the clamped SwiGLU between the projections,
the router weights applied, each token's k expert outputs summed.

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
    num_experts = no work)."""
    pairs = topk_ids.flatten().tolist()
    rows, experts = [], []
    for e in range(num_experts):
        mine = [p for p, x in enumerate(pairs) if x == e]
        for start in range(0, len(mine), block_m):
            chunk = mine[start:start + block_m]
            rows += chunk + [-1] * (block_m - len(chunk))
            experts.append(e)
    return rows, experts


def fused_moe_mxfp4_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                        w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                        limit: float) -> torch.Tensor:
    """x [T, D], topk_ids / topk_weights [T, k] -> [T, D] fp32: sum_j w_j * w2_e . swiglu_L(w1_e x, w3_e x)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13e = dequant_mxfp4_ref(w13[e], w13_scale[e])
        h = x[tok].float() @ w13e.T
        act = F.silu(h[:, :inter].clamp(max=limit)) * h[:, inter:].clamp(min=-limit, max=limit)
        y = act @ dequant_mxfp4_ref(w2[e], w2_scale[e]).T
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out
