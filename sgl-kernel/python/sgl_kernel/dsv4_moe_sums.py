"""The fused MoE's reductions over partial sums and its clamped SwiGLU, shared by its paths (dsv4_moe_general,
dsv4_moe_planes, dsv4_moe_gemv), each reduction one launch in a fixed order (deterministic):
- `swiglu_splits`: a parity planes' gate-up split over K leaves fp32 gate and up sums per split, [splits, rows, 2I]
  (gate in columns 0..I-1, up in I..2I-1); their sum in split order goes through the clamped SwiGLU into the
  intermediate rows;
- `combine_pairs`: each token's k weighted expert rows (one slice per down K split) summed in slot then split order
  in fp32 and cast to the activations' dtype (a torch sum and a cast were two launches: 3.1 + 1.0 us of a 1-token
  MoE on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_pdl import pdl_enter, pdl_launch

BLOCK = 1024  # columns per program of either reduction


@triton.jit
def clamped_swiglu(g, u, limit):
    """DeepSeek-V4's clamped SwiGLU of fp32 gate and up sums: silu(min(g, L)) * clamp(u, -L, L)."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _swiglu_splits_kernel(p_ptr, rows_ptr, h_ptr, I, stride_ps, stride_p, stride_h, limit, SPLITS: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    """h row r = the clamped SwiGLU of row r's gate and up sums over the K splits (added in split order); rows
    without a pair are skipped."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    if tl.load(rows_ptr + r) >= 0:
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = n < I
        row = p_ptr + r.to(tl.int64) * stride_p + n
        g = tl.load(row, mask=ok, other=0.0)
        u = tl.load(row + I, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            g += tl.load(row + s * stride_ps, mask=ok, other=0.0)
            u += tl.load(row + s * stride_ps + I, mask=ok, other=0.0)
        tl.store(h_ptr + r.to(tl.int64) * stride_h + n, clamped_swiglu(g, u, limit).to(h_ptr.dtype.element_ty),
                 mask=ok)


def swiglu_splits(part: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, limit: float,
                  pdl: bool = False) -> torch.Tensor:
    """part [splits, R, 2I] fp32 (rows contiguous), rows [R] (pair index or -1) -> out [R, I] written where a row
    holds a pair (silu(min(g, L)) * clamp(u, -L, L) of the summed splits); returns out. pdl: launched as a
    programmatic dependent (dsv4_pdl)."""
    inter = out.shape[1]
    _swiglu_splits_kernel[(out.shape[0], triton.cdiv(inter, BLOCK))](
        part, rows, out, inter, part.stride(0), part.stride(1), out.stride(0), float(limit), SPLITS=part.shape[0],
        BLOCK=BLOCK, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out


@triton.jit
def _combine_kernel(p_ptr, out_ptr, D, stride_s, TOPK: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = d < D
    rows = p_ptr + t.to(tl.int64) * TOPK * D + d
    acc = tl.load(rows, mask=ok, other=0.0)
    for i in tl.static_range(1, TOPK * SPLITS):  # slot order, then K split: the same bits on every run
        acc += tl.load(rows + (i // SPLITS) * D + (i % SPLITS) * stride_s, mask=ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * D + d, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine_pairs(pairs: torch.Tensor, top_k: int, dtype: torch.dtype, pdl: bool = False) -> torch.Tensor:
    """Each token's k weighted expert rows [T * k, D] fp32 (or one such slice per K split, [splits, T * k, D]; rows
    contiguous) -> their sum [T, D] in `dtype`. pdl: launched as a programmatic dependent (dsv4_pdl)."""
    splits, stride_s = (pairs.shape[0], pairs.stride(0)) if pairs.dim() == 3 else (1, 0)
    rows, hidden = pairs.shape[-2:]
    out = torch.empty(rows // top_k, hidden, dtype=dtype, device=pairs.device)
    if out.numel():
        _combine_kernel[(rows // top_k, triton.cdiv(hidden, BLOCK))](
            pairs, out, hidden, stride_s, TOPK=top_k, SPLITS=splits, BLOCK=BLOCK, PDL=pdl, num_warps=4,
            **pdl_launch(pdl))
    return out
