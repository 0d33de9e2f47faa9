"""Lightning-indexer logits of DeepSeek-V4 CSA layers (docs/dsv4-architecture.md 5.5, 9.4).

    out[t, e] = sum_h weights[t, h] * relu(q[t, h] . key[cand_slots[row_map[t], e]])   for e < visible[t]
    out[t, e] = -inf                                                                       otherwise
                (left unwritten with fill_invisible=False, for dsv4_topk_slots(visible=...), which never reads it)

Letters: T query rows, H (= nI) indexer heads, D (= dI) head dim, R candidate lists, E candidates per list.
Keys are read straight from the indexer key pool in one of three row layouts (dsv4_formats_ref.py):

* "dense":     [N, D] in a float dtype.
* "fp8_index": row = D e4m3 bytes, then one little-endian fp32 scale per 128 values (D <= 128 here: one scale).
* "fp4_index": row = D/2 bytes of e2m1 codes (low nibble = even index), then one ue8m0 byte 2^(b-127) per 32.

Design: the op is a skinny GEMM per row, [H, D] x [D, E], bound by reading the keys. A program owns a tile of
BLOCK_T rows and a run of E_BLOCKS x BLOCK_E candidates; it loads the rows' queries once as an [BLOCK_T*H, D]
operand, then per candidate block loads the keys once, dequantizes them in registers and computes every head
of every row of the tile with one tl.dot, applies ReLU and the head weights, and writes [BLOCK_T, BLOCK_E]
logits. Blocks past the tile's largest `visible` only write -inf (no key reads). The row-tile axis is the
fastest grid axis, so concurrent programs read the same candidate range (L2 reuse when rows share a list).

Decode (every row its own list: R >= T) uses BLOCK_T = 1. Prefill (R < T: rows of one request share a list)
uses BLOCK_T = 8, so each dequantized key tile serves eight rows; a tile straddling two requests is computed
once per distinct list and each pass stores only its own rows.

Precision: the dot runs in q's dtype (fp32: exact IEEE; bf16/fp16: tensor cores, fp32 accumulation). The
quantized codes are exact in every one of these dtypes (fp8 scale applied after the dot; fp4 values times
their power-of-two scale stay exact in bf16/fp32, and in fp16 while within its range).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_attention_ref import KEY_FORMATS, check_index_logits_args, dsv4_index_logits_ref
from sgl_kernel.dsv4_formats_ref import FP8_INDEX_BLOCK
from sgl_kernel.dsv4_target import dot_precision, lds_limit

_FORMAT_ID = {name: i for i, name in enumerate(KEY_FORMATS)}  # dense 0, fp8_index 1, fp4_index 2
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

BLOCK_E = 64  # candidates per tl.dot (the N of the GEMM)
E_BLOCKS = 8  # candidate blocks per program: the queries are loaded once per 512 candidates
PREFILL_ROWS_PER_TILE = 8  # rows sharing one dequantized key tile when rows share candidate lists


@triton.jit
def _load_keys(cache_ptr, slots, e_mask, stride_cache, HEAD_DIM: tl.constexpr, FORMAT: tl.constexpr,
               BLOCK_E: tl.constexpr, DOT_DTYPE: tl.constexpr, FP4_GATHER: tl.constexpr):
    """Keys [BLOCK_E, HEAD_DIM] in DOT_DTYPE and a per-key factor [BLOCK_E] to apply after the dot."""
    row = cache_ptr + slots.to(tl.int64) * stride_cache  # [BLOCK_E] row starts
    d = tl.arange(0, HEAD_DIM)
    if FORMAT == 0:
        keys = tl.load(row[:, None] + d[None, :], mask=e_mask[:, None], other=0.0).to(DOT_DTYPE)
        factor = tl.full([BLOCK_E], 1.0, tl.float32)
    elif FORMAT == 1:
        raw = tl.load(row[:, None] + d[None, :], mask=e_mask[:, None], other=0)
        keys = raw.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)  # e4m3 is exact in fp16/bf16/fp32
        bits = tl.zeros([BLOCK_E], tl.int32)
        for i in tl.static_range(4):  # little-endian fp32 scale after the codes
            bits |= tl.load(row + HEAD_DIM + i, mask=e_mask, other=0).to(tl.int32) << (8 * i)
        factor = bits.to(tl.float32, bitcast=True)
    elif not FP4_GATHER:
        NB: tl.constexpr = HEAD_DIM // 32
        j = tl.arange(0, HEAD_DIM // 2)
        packed = tl.load(row[:, None] + j[None, :], mask=e_mask[:, None], other=0).to(tl.int32)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), [BLOCK_E, HEAD_DIM])  # low nibble = even index
        # e2m1 bits s.e1e0.m placed at fp16 bits 15 and 11..9 read as e2m1 * 2^-14 (subnormals included).
        bits = ((codes & 7) << 9) | ((codes & 8) << 12)
        vals = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        b = tl.arange(0, NB)
        sb = tl.load(row[:, None] + HEAD_DIM // 2 + b[None, :], mask=e_mask[:, None], other=0).to(tl.int32)
        scale = (sb << 23).to(tl.float32, bitcast=True) * 16384.0  # 2^(b-127) * 2^14; byte 0 -> 0
        keys = tl.reshape(tl.reshape(vals, [BLOCK_E, NB, 32]) * scale[:, :, None], [BLOCK_E, HEAD_DIM])
        keys = keys.to(DOT_DTYPE)
        factor = tl.full([BLOCK_E], 1.0, tl.float32)
    else:  # the same decode with one gather per value (its byte and its scale byte: L1 hits), no reshapes
        byte = tl.load(row[:, None] + (d // 2)[None, :], mask=e_mask[:, None], other=0).to(tl.int32)
        codes = (byte >> ((d & 1) * 4)[None, :]) & 15
        bits = ((codes & 7) << 9) | ((codes & 8) << 12)
        vals = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sb = tl.load(row[:, None] + HEAD_DIM // 2 + (d // 32)[None, :], mask=e_mask[:, None], other=0).to(tl.int32)
        keys = (vals * ((sb << 23).to(tl.float32, bitcast=True) * 16384.0)).to(DOT_DTYPE)
        factor = tl.full([BLOCK_E], 1.0, tl.float32)
    return keys, factor


@triton.jit(do_not_specialize=["T", "E"])  # bounds only: no recompiles as the batch and context change
def _dsv4_index_logits_kernel(q_ptr, w_ptr, cache_ptr, cand_ptr, row_map_ptr, vis_ptr, out_ptr, T, E,
                              stride_qt, stride_qh, stride_wt, stride_cache, stride_cand, stride_out,
                              NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                              FORMAT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                              E_BLOCKS: tl.constexpr, HAS_ROW_MAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
                              DOT_PRECISION: tl.constexpr, FP4_GATHER: tl.constexpr, FILL: tl.constexpr):
    pid_t, pid_e = tl.program_id(0), tl.program_id(1)
    t_idx = tl.arange(0, BLOCK_T)
    rows = pid_t * BLOCK_T + t_idx
    row_ok = rows < T
    vis = tl.minimum(tl.load(vis_ptr + rows, mask=row_ok, other=0), E).to(tl.int32)  # [BLOCK_T]
    e_first = pid_e * (E_BLOCKS * BLOCK_E)
    if not FILL:
        if e_first >= tl.max(vis, axis=0):
            return  # no row of the tile sees these candidates, and nothing is written past what a row sees
    M: tl.constexpr = BLOCK_T * HEADS_PAD
    # GEMM rows m = (row of the tile, head); padded heads and rows past T load zeros.
    m = tl.arange(0, M)
    row_m, head_m = pid_t * BLOCK_T + m // HEADS_PAD, m % HEADS_PAD
    ok_m = (row_m < T) & (head_m < NUM_HEADS)
    d = tl.arange(0, HEAD_DIM)
    q_off = row_m.to(tl.int64)[:, None] * stride_qt + head_m[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=ok_m[:, None], other=0.0).to(DOT_DTYPE)  # [M, D]
    w = tl.load(w_ptr + row_m.to(tl.int64) * stride_wt + head_m, mask=ok_m, other=0.0).to(tl.float32)  # [M]

    if HAS_ROW_MAP:
        src = tl.load(row_map_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
    else:
        src = tl.where(row_ok, rows, -1)
    src_lo = tl.min(tl.where(row_ok, src, 2147483647), axis=0)
    num_pass = tl.where(src_lo == tl.max(src, axis=0), 1, BLOCK_T)  # one pass per row only on a mixed tile
    e_end = tl.minimum(e_first + E_BLOCKS * BLOCK_E, E)
    for p in range(num_pass):
        src_p = tl.where(num_pass == 1, src_lo, tl.sum(tl.where(t_idx == p, src, 0), axis=0))
        mine = row_ok & (src == src_p)
        vis_max = tl.max(tl.where(mine, vis, 0), axis=0)
        cand_row = cand_ptr + src_p.to(tl.int64) * stride_cand
        out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_out
        # Blocks holding a visible entry of some row of the pass: read keys; the rest: -inf only.
        num_vis = tl.maximum(tl.cdiv(tl.minimum(vis_max, e_end) - e_first, BLOCK_E), 0)
        for b in range(num_vis):
            e = e_first + b * BLOCK_E + tl.arange(0, BLOCK_E)
            e_mask = e < vis_max
            slots = tl.maximum(tl.load(cand_row + e, mask=e_mask, other=0), 0)
            keys, factor = _load_keys(cache_ptr, slots, e_mask, stride_cache, HEAD_DIM, FORMAT, BLOCK_E, DOT_DTYPE,
                                        FP4_GATHER)
            s = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * factor[None, :]  # [M, BLOCK_E]
            s = tl.maximum(s, 0.0) * w[:, None]
            if BLOCK_T == 1:
                logits = tl.sum(s, axis=0)[None, :]
            else:
                logits = tl.sum(tl.reshape(s, [BLOCK_T, HEADS_PAD, BLOCK_E]), axis=1)  # [BLOCK_T, BLOCK_E]
            logits = tl.where(e[None, :] < vis[:, None], logits, float("-inf"))
            tl.store(out_rows + e[None, :], logits, mask=mine[:, None] & (e < E)[None, :])
        if FILL:  # the blocks past every visible entry of the pass: -inf (FILL False: not written)
            for b in range(num_vis, E_BLOCKS):
                e = e_first + b * BLOCK_E + tl.arange(0, BLOCK_E)
                tl.store(out_rows + e[None, :], tl.full([BLOCK_T, BLOCK_E], float("-inf"), tl.float32),
                         mask=mine[:, None] & (e < E)[None, :])


def _check_kernel_limits(q: torch.Tensor, key_format: str) -> None:
    """What the kernel needs beyond the op's contract: tl.arange over dI, and one fp8 scale per row."""
    D = q.shape[2]
    assert D >= 16 and D & (D - 1) == 0, f"dI must be a power of two >= 16, got {D}"
    assert key_format != "fp8_index" or D <= FP8_INDEX_BLOCK, \
        f"fp8_index keys: one scale per row supported (dI <= {FP8_INDEX_BLOCK}), got dI={D}"


def _launch_config(shared_lists: bool, heads_pad: int, fp32: bool = False, lds: Optional[int] = None) -> dict:
    """Static launch settings (never keyed on token or candidate counts). BLOCK_T: rows per tile (> 1 only when
    rows share candidate lists: prefill); BLOCK_E x E_BLOCKS candidates per program; FP4_GATHER: decode FP4 keys
    with one gather per value instead of join/reshape. From the H200 sweep (benchmark/kernels/sweep_dsv4.py):
    FP4 gather decode 1.9x faster at batch 64; 8-row prefill tiles 2.2x (FP8) / 1.4x (FP4) faster than 2-row.
    fp32 queries (engine runs in fp32, the oracle checks) take 2-row tiles and one stage: 8 rows x 64 heads x 128
    fp32 staged twice need 311 KB of shared memory, an H200 has 227 KB. `lds`: a ROCm device's LDS bytes
    (dsv4_target.lds_limit): 8-row tiles take 128 KiB of LDS there (over gfx942's 64 KiB) and spill 400-900 bytes of
    registers on gfx950 (4-row tiles still 40 for FP8 keys), so shared lists take 2-row tiles on ROCm."""
    if shared_lists:
        return dict(BLOCK_T=2 if fp32 or lds is not None else PREFILL_ROWS_PER_TILE, BLOCK_E=64, E_BLOCKS=4,
                    FP4_GATHER=True, num_warps=8, num_stages=1 if fp32 else 2)
    return dict(BLOCK_T=1, BLOCK_E=BLOCK_E, E_BLOCKS=E_BLOCKS, FP4_GATHER=True,
                num_warps=4 if heads_pad <= 64 else 8, num_stages=1 if fp32 else 3)


def dsv4_index_logits(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, key_format: str,
                      cand_slots: torch.Tensor, row_map: Optional[torch.Tensor], visible: torch.Tensor,
                      out: torch.Tensor, launch_config: Optional[dict] = None,
                      fill_invisible: bool = True) -> torch.Tensor:
    """Index logits of every (row, candidate) into the caller's `out` [T, E] fp32 (all of it written; with
    fill_invisible=False the blocks past a row tile's visible entries are left as they were: a decode graph's lists
    span the context capacity, so writing -inf there cost more than the logits). launch_config overrides
    `_launch_config` (benchmark sweeps)."""
    check_index_logits_args(q, weights, key_cache, key_format, cand_slots, row_map, visible, out)
    _check_kernel_limits(q, key_format)
    T, H, D = q.shape
    R, E = cand_slots.shape
    if T == 0 or E == 0:
        return out
    heads_pad = max(16, triton.next_power_of_2(H))
    cfg = launch_config or _launch_config(row_map is not None and R < T, heads_pad, q.dtype == torch.float32,
                                          lds_limit(q.device))
    block_t, block_e, e_blocks = cfg["BLOCK_T"], cfg["BLOCK_E"], cfg["E_BLOCKS"]
    dot_dtype = _DOT_DTYPES[q.dtype]
    grid = (triton.cdiv(T, block_t), triton.cdiv(E, e_blocks * block_e))
    _dsv4_index_logits_kernel[grid](
        q, weights, key_cache, cand_slots, row_map if row_map is not None else visible, visible, out, T, E,
        q.stride(0), q.stride(1), weights.stride(0), key_cache.stride(0), cand_slots.stride(0), out.stride(0),
        NUM_HEADS=H, HEADS_PAD=heads_pad, HEAD_DIM=D, FORMAT=_FORMAT_ID[key_format], BLOCK_T=block_t,
        BLOCK_E=block_e, E_BLOCKS=e_blocks, HAS_ROW_MAP=row_map is not None, DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision(q.dtype, q.device), FP4_GATHER=cfg["FP4_GATHER"], FILL=fill_invisible,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


__all__ = ["dsv4_index_logits", "dsv4_index_logits_ref"]
