"""dsv4_moe_align: the fused MoE's first step, the (token, slot) pairs sorted by expert into blocks of BLOCK_M rows.

Each block holds one expert's pairs, padded with -1; `block_expert[b]` is the block's expert. Pairs whose id is -1
(another rank's expert under expert parallelism) come last, in blocks of expert E: no GEMM runs for them, the down
kernels only write their rows 0. Blocks past the work have expert E + 1. The block count is capacity-static:
ceil(T*k / BLOCK_M) + min(E + 1, T*k) bounds it. No host read: graph-capturable. One Triton program up to 2,048
pairs, else torch ops. The torch reference is dsv4_moe_ref.align_ref.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_pdl import pdl_enter


# Up to this many (token, slot) pairs one program sorts them (decode, short prefill chunks); more: torch ops. On an
# H200 the program took 2.4 / 9.5 / 23.1 / 217.6 us at 6 / 768 / 1,536 / 6,144 pairs, the torch ops 47-81 / 124.5 us.
ALIGN_ONE_PROGRAM_PAIRS = 2048


def dsv4_moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_program: Optional[bool] = None,
                   pdl: bool = False) -> tuple:
    """topk_ids [T, k] (-1: not this rank's expert) -> (rows [num_blocks * block_m] int64: pair index t*k + j or -1;
    block_expert [num_blocks] int64: the block's expert, num_experts for the blocks of -1 pairs, num_experts + 1 past
    the work). one_program (default: on a GPU, up to ALIGN_ONE_PROGRAM_PAIRS pairs): one Triton program instead of
    ~12 small torch kernels (decode: ~50 us of a 1-token MoE on an H200 were these launches). pdl: the one program
    lets the next kernel, launched as a programmatic dependent, be scheduled at once (dsv4_pdl)."""
    n = topk_ids.numel()
    num_blocks = triton.cdiv(n, block_m) + min(num_experts + 1, n)
    if one_program is None:
        one_program = topk_ids.is_cuda and one_program_sort_width(n) is not None
    if one_program:
        return _align_one_program(topk_ids, num_experts, block_m, num_blocks, pdl)
    flat = topk_ids.flatten().long()
    flat = torch.where(flat < 0, num_experts, flat)  # other ranks' pairs: bucket E, sorted last
    device = flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read the device
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    rows = torch.full((num_blocks * block_m,), -1, dtype=torch.int64, device=device)
    rows[(ends - padded)[sorted_e] + rank] = order
    block_expert = torch.searchsorted(ends, torch.arange(num_blocks, device=device) * block_m, right=True)
    return rows, block_expert


@triton.jit
def _align_kernel(ids_ptr, rows_ptr, bexp_ptr, pad_ptr, n, E, num_rows, num_blocks, BLOCK_M: tl.constexpr,
                  P: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr):
    """dsv4_moe_align in one program, without per-pair cross-thread reductions (the pairwise-rank version spent ~30 us
    in 1,300 warp reductions at 192 pairs on an H200): per-expert counts (a histogram; padding lanes in bin EP - 1,
    past E), each expert's padding before it (an exclusive cumulative sum, kept in pad_ptr), the pairs sorted by
    (expert, pair index) (a stable sort by expert), and each sorted pair's row = its sorted position + the padding
    before its expert; each pair also writes its block's expert (every block of an expert holds one of its pairs).
    A barrier orders the fills and the scratch write before the scatters and the gather."""
    pdl_enter(PDL)
    i = tl.arange(0, P)
    ok = i < n
    ids = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
    ids = tl.where(ok, tl.where(ids < 0, E, ids), EP - 1)
    e = tl.arange(0, EP)
    counts = tl.where(e <= E, tl.histogram(ids, EP), 0)
    pad = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M - counts
    tl.store(pad_ptr + e, tl.cumsum(pad, 0) - pad)
    for r0 in range(0, num_rows, 1024):
        r = r0 + tl.arange(0, 1024)
        tl.store(rows_ptr + r, tl.full([1024], -1, tl.int64), mask=r < num_rows)
    for b0 in range(0, num_blocks, 1024):
        b = b0 + tl.arange(0, 1024)
        tl.store(bexp_ptr + b, tl.full([1024], 0, tl.int64) + E + 1, mask=b < num_blocks)
    key = tl.sort(ids * P + i)  # padding lanes (bin EP - 1) sort last
    tl.debug_barrier()
    expert = key // P
    valid = expert <= E
    row = i + tl.load(pad_ptr + expert, mask=valid, other=0, cache_modifier=".cg")
    tl.store(rows_ptr + row, (key % P).to(tl.int64), mask=valid)
    tl.store(bexp_ptr + row // BLOCK_M, expert.to(tl.int64), mask=valid)


def one_program_sort_width(pairs: int) -> Optional[int]:
    """Keys the one-program align sorts for `pairs` (expert, pair) pairs on a GPU by default (its compiled variant),
    or None where the default is the torch path (more than ALIGN_ONE_PROGRAM_PAIRS pairs). The server's warm-up
    plans its prompts from this."""
    return max(16, triton.next_power_of_2(pairs)) if pairs <= ALIGN_ONE_PROGRAM_PAIRS else None


def _align_one_program(topk_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int,
                       pdl: bool) -> tuple:
    n, device = topk_ids.numel(), topk_ids.device
    rows = torch.empty(num_blocks * block_m, dtype=torch.int64, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int64, device=device)
    ep = triton.next_power_of_2(num_experts + 2)  # bins 0..E and one past for padding lanes
    pad_before = torch.empty(ep, dtype=torch.int32, device=device)
    p = max(16, triton.next_power_of_2(n))  # one_program_sort_width's, also past the default's bound
    if p > 16384 or ep * p >= 2**31:  # shared memory for the sort; keys expert * P + pair in int32
        raise ValueError(f"one_program aligns up to 16,384 pairs with expert * pairs < 2^31, got {n} pairs and "
                         f"{num_experts} experts: use one_program=False")
    _align_kernel[(1,)](topk_ids.contiguous().view(-1), rows, block_expert, pad_before, n, num_experts, rows.numel(),
                        num_blocks, BLOCK_M=block_m, P=p, EP=ep, PDL=pdl,
                        num_warps=4 if p <= 256 else 8 if p <= 2048 else 16)
    return rows, block_expert
