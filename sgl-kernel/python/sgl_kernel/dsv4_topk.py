"""Top-k of the lightning-indexer logits, returned as physical pool slots (docs/dsv4-architecture.md 5.5).

    out[t, :] = { cand_slots[row_map[t], e] : e among the k largest finite logits[t, e] }, -1 padded

Letters: T rows, E candidates per row, R candidate lists, k selected (512 Flash, 1024 Pro), C chunk.

Algorithm: radix select in registers, applied level by level over chunks.

* Keys: each fp32 logit becomes an order-preserving uint32 (sign bit flipped for x >= 0, all bits flipped for
  x < 0); non-finite logits (masked entries are -inf) become 0, below every finite key.
* One program selects the top-k of one chunk of C <= 8k values held in registers: K = min(k, #finite), then
  a binary radix search over the key bits from the top fixes the K-th largest key v (per bit, one block
  count of keys >= prefix | bit; it stops as soon as exactly K keys clear the prefix, usually well before
  bit 0). Selected = keys > v, plus the first K - #(keys > v) keys equal to v in column order (cumsum rank).
  A cumsum over the selection gives each pick its output position: no atomics, deterministic.
* Level 1 runs one program per (row, chunk) over the logits and writes each chunk's k survivors (value and
  column) to a [T, S*k] workspace; each further level does the same on the survivors (8x fewer values per
  level); the level whose input fits one chunk maps columns to slots and writes the output row.
  262,144 candidates: 64 -> 8 -> 1 chunks at k = 512 (C = 4096), 32 -> 4 -> 1 at k = 1024 (C = 8192).
  Ties at the threshold keep the lowest columns at every level, so the result is the top-k by (value desc,
  column asc), independent of the chunking.

The logits are read once from global memory; later levels read 1/8 of the previous level's input.

With `visible` [T] (the indexer's visible entries per row) only columns e < visible[t] count: the rest are not read
(their logits may hold anything: dsv4_index_logits(fill_invisible=False) leaves them unwritten), a level's input from
a chunk of the level before that started at or past visible[t] is not read either, and a program whose whole chunk
lies there writes nothing. A decode graph's candidate lists span the context capacity (262,144 CSA entries at 1M
tokens) while a request sees floor(seq_len / 4): the work then follows the visible entries, not the capacity.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_attention_ref import check_topk_args, dsv4_topk_slots_ref

CHUNK_PER_K = 8  # chunk = 8 * next_pow2(k): each level shrinks its input 8x
MIN_CHUNK = 256
MAX_K = 4096  # chunk 32768 = 32 warps x 32 values per thread
VALUES_PER_THREAD = 32


@triton.jit
def _order_keys(x):
    """fp32 -> uint32 with the same order; NaN and +-inf -> 0 (below every finite value)."""
    u = x.to(tl.uint32, bitcast=True)
    key = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
    return tl.where((x > float("-inf")) & (x < float("inf")), key, 0)


@triton.jit
def _kth_key(keys, k):
    """Return (v, K): v is a key with #(keys >= v) >= K and #(keys > v) < K, K = min(k, #nonzero keys)."""
    num_valid = tl.sum((keys != 0).to(tl.int32), axis=0)
    K = tl.minimum(num_valid, k)
    v = tl.where(num_valid <= k, 1, 0).to(tl.uint32)  # few enough: every nonzero key is taken
    done = (num_valid <= k).to(tl.int32)
    bit = tl.full([], 31, tl.int32)
    while (bit >= 0) & (done == 0):
        trial = v | (tl.full([], 1, tl.uint32) << bit.to(tl.uint32))
        count = tl.sum((keys >= trial).to(tl.int32), axis=0)
        if count >= K:
            v = trial
            done = (count == K).to(tl.int32)
        bit -= 1
    return v, K


@triton.jit
def _visible_inputs(vis, k, depth, CHUNK: tl.constexpr):
    """How many inputs of a level `depth` levels after the first stem from logits columns below `vis`: input i of a
    level is a survivor of chunk i // k of the level before, whose first input is (i // k) * CHUNK there, so an input
    i counts iff i < the bound below (one scalar per row: a per-input int64 division cost ~12 us a CSA layer at
    batch 1)."""
    bound = vis
    for _ in range(depth):
        bound = tl.cdiv(bound, CHUNK) * k
    return bound


@triton.jit(do_not_specialize=["n", "k", "depth"])
def _topk_level_kernel(val_ptr, col_ptr, stride_in, n, k, next_val_ptr, next_col_ptr, stride_next,
                       cand_ptr, stride_cand, row_map_ptr, out_ptr, stride_out, vis_ptr, depth,
                       CHUNK: tl.constexpr, K_PAD: tl.constexpr, HAS_COLS: tl.constexpr, IS_LAST: tl.constexpr,
                       HAS_ROW_MAP: tl.constexpr, HAS_VIS: tl.constexpr):
    """One (row, chunk) of the level `depth` levels after the first. With HAS_VIS an input counts only if the
    logits column it stems from is below visible[t] (_visible_inputs)."""
    t, c = tl.program_id(0), tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < n
    if HAS_VIS:
        bound = _visible_inputs(tl.load(vis_ptr + t).to(tl.int64), k, depth, CHUNK)
        in_range = in_range & (offs < bound)
        if not IS_LAST:
            if c * CHUNK >= bound:
                return  # nothing of this chunk is visible: the next level does not read its survivors
    row_in = t.to(tl.int64) * stride_in
    vals = tl.load(val_ptr + row_in + offs, mask=in_range, other=float("-inf"))
    if HAS_COLS:
        cols = tl.load(col_ptr + row_in + offs, mask=in_range, other=0)
    else:
        cols = offs
    keys = _order_keys(vals)
    v, K = _kth_key(keys, k)
    above = keys > v
    tied = keys == v
    need = K - tl.sum(above.to(tl.int32), axis=0)
    pick = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))
    pos = tl.cumsum(pick.to(tl.int32), axis=0) - 1
    pad = tl.arange(0, K_PAD)
    pad_mask = (pad >= K) & (pad < k)
    if IS_LAST:
        if HAS_ROW_MAP:
            src = tl.load(row_map_ptr + t).to(tl.int64)
        else:
            src = t.to(tl.int64)
        slots = tl.load(cand_ptr + src * stride_cand + cols, mask=pick, other=-1).to(tl.int64)
        out_row = out_ptr + t.to(tl.int64) * stride_out
        tl.store(out_row + pos, slots, mask=pick)
        tl.store(out_row + pad, tl.full([K_PAD], -1, tl.int64), mask=pad_mask)
    else:
        base = t.to(tl.int64) * stride_next + c * k
        tl.store(next_val_ptr + base + pos, vals, mask=pick)
        tl.store(next_col_ptr + base + pos, cols.to(tl.int32), mask=pick)
        tl.store(next_val_ptr + base + pad, tl.full([K_PAD], float("-inf"), tl.float32), mask=pad_mask)
        tl.store(next_col_ptr + base + pad, tl.zeros([K_PAD], tl.int32), mask=pad_mask)


def topk_config(k: int, chunk_per_k: int = CHUNK_PER_K) -> tuple:
    """(K_PAD, CHUNK, num_warps) for k: a function of k only."""
    k_pad = triton.next_power_of_2(max(k, 1))
    chunk = max(MIN_CHUNK, chunk_per_k * k_pad)
    return k_pad, chunk, max(1, min(32, chunk // (32 * VALUES_PER_THREAD)))


def dsv4_topk_slots(logits: torch.Tensor, cand_slots: torch.Tensor, row_map: Optional[torch.Tensor],
                    k: int, launch_config: Optional[dict] = None,
                    visible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[T, k] int64: slots of each row's k largest finite logits (column order, then -1 padding); with `visible`
    [T] integers only of its columns e < visible[t] (the others not read). launch_config: {"CHUNK_PER_K"} overrides
    (benchmark sweeps)."""
    check_topk_args(logits, cand_slots, row_map, k, visible)
    assert k <= MAX_K, f"k must be at most {MAX_K}, got {k}"
    T, E = logits.shape
    out = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return out
    if E == 0:
        return out.fill_(-1)
    cfg = launch_config or dict(CHUNK_PER_K=CHUNK_PER_K)
    k_pad, chunk, num_warps = topk_config(k, cfg["CHUNK_PER_K"])
    vals, cols, n, depth = logits, None, E, 0
    while True:
        num_chunks = triton.cdiv(n, chunk)
        last = num_chunks == 1
        if last:
            nxt_vals = nxt_cols = None
        else:
            nxt_vals = torch.empty(T, num_chunks * k, dtype=torch.float32, device=logits.device)
            nxt_cols = torch.empty(T, num_chunks * k, dtype=torch.int32, device=logits.device)
        _topk_level_kernel[(T, num_chunks)](
            vals, cols if cols is not None else vals, vals.stride(0), n, k,
            nxt_vals if not last else vals, nxt_cols if not last else vals, nxt_vals.stride(0) if not last else 0,
            cand_slots, cand_slots.stride(0), row_map if row_map is not None else cand_slots, out, out.stride(0),
            visible if visible is not None else out, depth,
            CHUNK=chunk, K_PAD=k_pad, HAS_COLS=cols is not None, IS_LAST=last, HAS_ROW_MAP=row_map is not None,
            HAS_VIS=visible is not None, num_warps=num_warps)
        if last:
            return out
        vals, cols, n, depth = nxt_vals, nxt_cols, num_chunks * k, depth + 1


__all__ = ["dsv4_topk_slots", "dsv4_topk_slots_ref", "topk_config"]
