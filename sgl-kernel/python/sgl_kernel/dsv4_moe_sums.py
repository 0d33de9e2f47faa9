"""The fused MoE's reductions over partial sums and its clamped SwiGLU, shared by its paths (dsv4_moe_general,
dsv4_moe_planes, dsv4_moe_gemv), each reduction one launch in a fixed order (deterministic):
- `swiglu_splits`: a parity planes' gate-up split over K leaves fp32 gate and up sums per split, [splits, rows, 2I]
  (gate in columns 0..I-1, up in I..2I-1); their sum in split order goes through the clamped SwiGLU into the
  intermediate rows;
- `combine_pairs`: each token's k weighted expert rows (one slice per down K split) summed in slot then split order
  in fp32 and cast to the activations' dtype (a torch sum and a cast were two launches: 3.1 + 1.0 us of a 1-token
  MoE on an H200); with `add`, the shared expert's output added after that cast (`add_rounded`), as the torch sum
  `routed + shared` adds: one launch fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_pdl import pdl_enter, pdl_launch
from sgl_kernel.dsv4_rmsnorm import round_to

BLOCK = 1024  # columns per program of either reduction


@triton.jit
def clamped_swiglu(g, u, limit):
    """DeepSeek-V4's clamped SwiGLU of fp32 gate and up sums: silu(min(g, L)) * clamp(u, -L, L)."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def add_rounded(total, add_ptr, mask, ty, ADD: tl.constexpr, BF16_BITS: tl.constexpr):
    """fp32 sums -> ty; ADD: plus the values at add_ptr (in ty; `mask`: where to load), added as torch adds two ty
    tensors (the sums rounded to ty first, the sum of the two in fp32 rounded again): `routed + shared` bit for bit.
    BF16_BITS: as round_to's."""
    out = round_to(total, ty, BF16_BITS)
    if ADD:
        out = round_to(out.to(tl.float32) + tl.load(add_ptr, mask=mask, other=0.0).to(tl.float32), ty, BF16_BITS)
    return out


def bf16_bits(dtype: torch.dtype, device: torch.device) -> bool:
    """round_to's BF16_BITS: bf16 results of kernels the CPU interpreter runs."""
    return dtype == torch.bfloat16 and device.type != "cuda"


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
def _combine_kernel(p_ptr, add_ptr, out_ptr, D, stride_s, stride_a, TOPK: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr, ADD: tl.constexpr, BF16_BITS: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = d < D
    rows = p_ptr + t.to(tl.int64) * TOPK * D + d
    acc = tl.load(rows, mask=ok, other=0.0)
    for i in tl.static_range(1, TOPK * SPLITS):  # slot order, then K split: the same bits on every run
        acc += tl.load(rows + (i // SPLITS) * D + (i % SPLITS) * stride_s, mask=ok, other=0.0)
    out = add_rounded(acc, add_ptr + t.to(tl.int64) * stride_a + d, ok, out_ptr.dtype.element_ty, ADD, BF16_BITS)
    tl.store(out_ptr + t.to(tl.int64) * D + d, out, mask=ok)


def check_add(add, tokens: int, hidden: int, dtype: torch.dtype) -> None:
    """`add` (rows added to a MoE's output) must be [tokens, hidden] in the output's dtype with contiguous rows."""
    if add is not None and (tuple(add.shape) != (tokens, hidden) or add.dtype != dtype or add.stride(-1) != 1):
        raise ValueError(f"rows to add {tuple(add.shape)} {add.dtype} stride {add.stride()}: expected [{tokens}, "
                         f"{hidden}] {dtype} with contiguous rows")


def combine_pairs(pairs: torch.Tensor, top_k: int, dtype: torch.dtype, pdl: bool = False,
                  add: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's k weighted expert rows [T * k, D] fp32 (or one such slice per K split, [splits, T * k, D]; rows
    contiguous) -> their sum [T, D] in `dtype`, plus `add` [T, D] (in `dtype`, rows contiguous) if given, added as
    torch adds the rounded sum and it. pdl: launched as a programmatic dependent (dsv4_pdl)."""
    splits, stride_s = (pairs.shape[0], pairs.stride(0)) if pairs.dim() == 3 else (1, 0)
    rows, hidden = pairs.shape[-2:]
    check_add(add, rows // top_k, hidden, dtype)
    out = torch.empty(rows // top_k, hidden, dtype=dtype, device=pairs.device)
    if out.numel():
        _combine_kernel[(rows // top_k, triton.cdiv(hidden, BLOCK))](
            pairs, out if add is None else add, out, hidden, stride_s, 0 if add is None else add.stride(0),
            TOPK=top_k, SPLITS=splits, BLOCK=BLOCK, PDL=pdl, ADD=add is not None,
            BF16_BITS=bf16_bits(dtype, pairs.device), num_warps=4, **pdl_launch(pdl))
    return out
