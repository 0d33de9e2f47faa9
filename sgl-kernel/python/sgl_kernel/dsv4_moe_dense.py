"""The fused MoE's kernels for unquantized (bf16 / fp16 / fp32) expert weights: the general kernels' sorted-block
structure (dsv4_moe_general) with the weight tiles loaded as they are, for GPUs where torch has no grouped GEMM for
the dtype or the widths (fp32 on a GPU, GPUs before Hopper, ROCm builds without it, rows that are not whole 16-byte
units). The door (dsv4_moe.dsv4_moe_dense) calls them after the sort (dsv4_moe_align) and before the per-token sums
(dsv4_moe_sums.combine_pairs); no host read, graph-capturable.

- `_dense_gate_up_kernel`: per expert block and BLOCK_N tile of the intermediate dim, the block's x rows (gathered by
  token) times the expert's w1 and w3 rows, accumulated in fp32, then the clamped SwiGLU, written in x's dtype to one
  intermediate row per padded row (the grouped GEMM's intermediate precision).
- `_dense_down_kernel`: the intermediate rows times w2, in fp32, scaled by the pair's router weight, written to the
  pair's row of a [T*k, D] fp32 buffer; blocks of another rank's experts (expert E) write zeros there.
Weights come with their strides (w1 / w3 may be the halves of one [E, 2I, D] tensor); fp32 dots take IEEE precision
(no TF32: fp32 engines are the oracle checks), 16-bit ones the MMA's own; the CPU interpreter, whose dot misreads
bf16 operands, takes them upcast to fp32 (exact products, as the MMA's). The torch reference is
dsv4_moe_ref.fused_moe_dense_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_moe_common import MoeConfig, MoeLaunch, block_and_tile, block_major_grid
from sgl_kernel.dsv4_moe_sums import clamped_swiglu
from sgl_kernel.dsv4_pdl import interpreting
from sgl_kernel.dsv4_target import dot_precision


def dense_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    """Launch settings by pairs per expert (static for a batch size), as moe_config picks the block rows: 16-row
    blocks for decode, 64 / 128 for prefill. K tiles hold 128 bytes of a row (64 bf16 inputs, 32 fp32) and two
    stages, so the largest gate-up program (128 rows, two 64-row weight tiles) keeps 64 KB of shared memory: within
    every NVIDIA GPU from sm80 (consumer parts included) and AMD's. Not swept on a GPU yet: the choice of a safe
    default, not a measured best."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 64 if per_expert <= 64 else 128
    launch = MoeLaunch(64, 1024 // torch.finfo(dtype).bits, 4, 2, scaled_dot=False)
    return MoeConfig(block_m, launch, launch)


@triton.jit
def _weight_tile(w_ptr, rows, row_ok, k0, K, stride_wn, stride_wk, BLOCK_K: tl.constexpr):
    """Weight rows `rows` at inputs k0 .. k0 + BLOCK_K [BLOCK_N, BLOCK_K], as stored (masked: 0)."""
    k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + k[None, :] * stride_wk
    return tl.load(ptrs, mask=row_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _act_tile(a_ptr, arow, valid, stride_a, k0, K, BLOCK_K: tl.constexpr):
    """Activation rows `arow` at inputs k0 .. k0 + BLOCK_K [BLOCK_M, BLOCK_K] (invalid rows and inputs 0)."""
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(a_ptr + arow.to(tl.int64)[:, None] * stride_a + k[None, :],
                   mask=valid[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _dot(a, w, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a [M, K] times w [N, K] transposed, fp32 sums; UPCAST: the operands in fp32 first (the interpreter's bf16)."""
    if UPCAST:  # static branches, one return (Triton checks that returns agree in type)
        acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), out_dtype=tl.float32, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w), out_dtype=tl.float32, input_precision=PREC)
    return acc


@triton.jit
def _dense_gate_up_kernel(x_ptr, rows_ptr, bexp_ptr, w1_ptr, w3_ptr, h_ptr, D, I, TOPK, E, stride_x, stride_w1e,
                          stride_w1n, stride_w1k, stride_w3e, stride_w3n, stride_w3k, stride_h, limit,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                          UPCAST: tl.constexpr):
    """One block x one BLOCK_N tile of the intermediate dim, over all of D."""
    blk, tile = block_and_tile(I, BLOCK_N)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        tok = tl.where(valid, pair // TOPK, 0)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        w1_e = w1_ptr + e.to(tl.int64) * stride_w1e
        w3_e = w3_ptr + e.to(tl.int64) * stride_w3e
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            xk = _act_tile(x_ptr, tok, valid, stride_x, k0, D, BLOCK_K)
            g = _weight_tile(w1_e, n, n_ok, k0, D, stride_w1n, stride_w1k, BLOCK_K)
            u = _weight_tile(w3_e, n, n_ok, k0, D, stride_w3n, stride_w3k, BLOCK_K)
            acc_g += _dot(xk, g, PREC, UPCAST)
            acc_u += _dot(xk, u, PREC, UPCAST)
        act = clamped_swiglu(acc_g, acc_u, limit)
        h_rows = h_ptr + r.to(tl.int64)[:, None] * stride_h + n[None, :]
        tl.store(h_rows, act.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _dense_down_kernel(h_ptr, rows_ptr, bexp_ptr, w_ptr, wts_ptr, out_ptr, D, I, E, stride_h, stride_we, stride_wn,
                       stride_wk, stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One block x one BLOCK_N tile of the outputs, over all of I: the pairs' weighted rows."""
    blk, tile = block_and_tile(D, BLOCK_N)
    e = tl.load(bexp_ptr + blk)
    r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    if e < E:
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        w_e = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            hk = _act_tile(h_ptr, r, valid, stride_h, k0, I, BLOCK_K)
            w = _weight_tile(w_e, n, n_ok, k0, I, stride_wn, stride_wk, BLOCK_K)
            acc += _dot(hk, w, PREC, UPCAST)
        wt = tl.load(wts_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
        out_rows = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_o + n[None, :]
        tl.store(out_rows, acc * wt[:, None], mask=valid[:, None] & n_ok[None, :])
    elif e == E:  # pairs of another rank's experts: their rows of the pair buffer are 0
        pair = tl.load(rows_ptr + r)
        valid = pair >= 0
        out_rows = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_o + n[None, :]
        tl.store(out_rows, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=valid[:, None] & n_ok[None, :])


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreting()


def dense_gate_up(x, rows, block_expert, w1, w3, top_k: int, limit: float, block_m: int,
                  launch: MoeLaunch) -> torch.Tensor:
    """The activated intermediate rows [num_blocks * block_m, I] in x's dtype (rows without a pair unwritten)."""
    num_blocks, hidden = block_expert.shape[0], x.shape[1]
    num_experts, inter = w1.shape[0], w1.shape[1]
    out = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    _dense_gate_up_kernel[block_major_grid(num_blocks, inter, launch.block_n)](
        x, rows, block_expert, w1, w3, out, hidden, inter, top_k, num_experts, x.stride(0), *w1.stride(), *w3.stride(),
        out.stride(0), float(limit), BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        PREC=dot_precision(x.dtype, x.device), UPCAST=_upcast(x.dtype), num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return out


def dense_down(h, rows, block_expert, w2, weights, block_m: int, launch: MoeLaunch) -> torch.Tensor:
    """Each (token, slot) pair's weighted expert output [T * k, D] fp32 (weights: the router weights flattened,
    fp32)."""
    num_blocks, inter = block_expert.shape[0], h.shape[1]
    num_experts, hidden = w2.shape[0], w2.shape[1]
    pairs = torch.empty(weights.numel(), hidden, dtype=torch.float32, device=h.device)
    _dense_down_kernel[block_major_grid(num_blocks, hidden, launch.block_n)](
        h, rows, block_expert, w2, weights, pairs, hidden, inter, num_experts, h.stride(0), *w2.stride(),
        pairs.stride(0), BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        PREC=dot_precision(h.dtype, h.device), UPCAST=_upcast(h.dtype), num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return pairs
