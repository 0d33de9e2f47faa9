"""Lightning-indexer logits of DeepSeek-V4 CSA layers (docs/dsv4-architecture.md 5.5, 9.4).

    out[t, e] = sum_h weights[t, h] * relu(q[t, h] . key[cand_slots[row_map[t], e]])   for e < visible[t]
    out[t, e] = -inf                                                                       otherwise

Letters: T query rows, H (= nI) indexer heads, D (= dI) head dim, R candidate lists, E candidates per list.
Keys are read straight from the indexer key pool in one of three byte layouts (the engine's `kv_formats`):

* "dense": [N, D] in a float dtype.
* "fp8":   row = D e4m3 bytes, then one little-endian fp32 scale per 128 values (D <= 128 here: one scale).
* "fp4":   row = D/2 bytes of e2m1 codes (low nibble = even index), then one ue8m0 byte 2^(b-127) per 32.

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

FORMATS = ("dense", "fp8", "fp4")
_FORMAT_ID = {"dense": 0, "fp8": 1, "fp4": 2}
FP8_BLOCK, FP4_BLOCK = 128, 32
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

BLOCK_E = 64  # candidates per tl.dot (the N of the GEMM)
E_BLOCKS = 8  # candidate blocks per program: the queries are loaded once per 512 candidates
PREFILL_ROWS_PER_TILE = 8  # rows sharing one dequantized key tile when rows share candidate lists
_REF_GATHER_BYTES = 256 << 20  # the reference gathers keys [rows, E, D] fp32 in blocks of at most this


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
                              DOT_PRECISION: tl.constexpr, FP4_GATHER: tl.constexpr):
    pid_t, pid_e = tl.program_id(0), tl.program_id(1)
    M: tl.constexpr = BLOCK_T * HEADS_PAD
    # GEMM rows m = (row of the tile, head); padded heads and rows past T load zeros.
    m = tl.arange(0, M)
    row_m, head_m = pid_t * BLOCK_T + m // HEADS_PAD, m % HEADS_PAD
    ok_m = (row_m < T) & (head_m < NUM_HEADS)
    d = tl.arange(0, HEAD_DIM)
    q_off = row_m.to(tl.int64)[:, None] * stride_qt + head_m[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=ok_m[:, None], other=0.0).to(DOT_DTYPE)  # [M, D]
    w = tl.load(w_ptr + row_m.to(tl.int64) * stride_wt + head_m, mask=ok_m, other=0.0).to(tl.float32)  # [M]

    t_idx = tl.arange(0, BLOCK_T)
    rows = pid_t * BLOCK_T + t_idx
    row_ok = rows < T
    if HAS_ROW_MAP:
        src = tl.load(row_map_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
    else:
        src = tl.where(row_ok, rows, -1)
    vis = tl.minimum(tl.load(vis_ptr + rows, mask=row_ok, other=0), E).to(tl.int32)  # [BLOCK_T]
    src_lo = tl.min(tl.where(row_ok, src, 2147483647), axis=0)
    num_pass = tl.where(src_lo == tl.max(src, axis=0), 1, BLOCK_T)  # one pass per row only on a mixed tile
    e_first = pid_e * (E_BLOCKS * BLOCK_E)
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
        for b in range(num_vis, E_BLOCKS):
            e = e_first + b * BLOCK_E + tl.arange(0, BLOCK_E)
            tl.store(out_rows + e[None, :], tl.full([BLOCK_T, BLOCK_E], float("-inf"), tl.float32),
                     mask=mine[:, None] & (e < E)[None, :])


def _check(q, weights, key_cache, key_format, cand_slots, row_map, visible, out) -> None:
    assert q.dim() == 3 and q.dtype in _DOT_DTYPES and q.stride(2) == 1, \
        "q: [T, nI, dI] fp32/bf16/fp16, last dim contiguous"
    T, H, D = q.shape
    assert D >= 16 and D & (D - 1) == 0, f"dI must be a power of two >= 16, got {D}"
    assert weights.shape == (T, H) and weights.stride(1) == 1, "weights: [T, nI], last dim contiguous"
    assert key_format in FORMATS, f"key_format {key_format!r} not in {FORMATS}"
    assert key_cache.dim() == 2 and key_cache.stride(1) == 1, "key_cache: [N, row width] with contiguous rows"
    if key_format == "dense":
        assert key_cache.is_floating_point() and key_cache.shape[1] == D, "dense keys: [N, dI] floats"
    elif key_format == "fp8":
        assert D <= FP8_BLOCK, f"fp8 keys: one scale per row supported (dI <= {FP8_BLOCK}), got dI={D}"
        assert key_cache.dtype == torch.uint8 and key_cache.shape[1] == D + 4, "fp8 keys: uint8 rows of dI + 4 bytes"
    else:
        assert D % FP4_BLOCK == 0, f"fp4 keys: dI must be a multiple of {FP4_BLOCK}"
        assert key_cache.dtype == torch.uint8 and key_cache.shape[1] == D // 2 + D // FP4_BLOCK, \
            "fp4 keys: uint8 rows of dI/2 + dI/32 bytes"
    assert cand_slots.dim() == 2 and not cand_slots.is_floating_point(), "cand_slots: [R, E] integers"
    assert cand_slots.stride(1) == 1 or cand_slots.shape[1] <= 1, "cand_slots: last dim contiguous"
    assert row_map is None or row_map.shape == (T,), "row_map: [T] or None"
    assert row_map is not None or cand_slots.shape[0] >= T, "without row_map, cand_slots needs one row per query"
    assert visible.shape == (T,), "visible: [T]"
    assert out.shape == (T, cand_slots.shape[1]) and out.dtype == torch.float32, "out: [T, E] fp32"
    assert out.stride(1) == 1 or out.shape[1] <= 1, "out: last dim contiguous"


def _launch_config(shared_lists: bool, heads_pad: int) -> dict:
    """Static launch settings (never keyed on token or candidate counts). BLOCK_T: rows per tile (> 1 only when
    rows share candidate lists: prefill); BLOCK_E x E_BLOCKS candidates per program; FP4_GATHER: decode FP4 keys
    with one gather per value instead of join/reshape. From the H200 sweep (benchmark/kernels/sweep_dsv4.py):
    FP4 gather decode 1.9x faster at batch 64; 8-row prefill tiles 2.2x (FP8) / 1.4x (FP4) faster than 2-row."""
    if shared_lists:
        return dict(BLOCK_T=PREFILL_ROWS_PER_TILE, BLOCK_E=64, E_BLOCKS=4, FP4_GATHER=True,
                    num_warps=8, num_stages=2)
    return dict(BLOCK_T=1, BLOCK_E=BLOCK_E, E_BLOCKS=E_BLOCKS, FP4_GATHER=True,
                num_warps=4 if heads_pad <= 64 else 8, num_stages=3)


def dsv4_index_logits(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, key_format: str,
                      cand_slots: torch.Tensor, row_map: Optional[torch.Tensor], visible: torch.Tensor,
                      out: torch.Tensor, launch_config: Optional[dict] = None) -> torch.Tensor:
    """Index logits of every (row, candidate) into the caller's `out` [T, E] fp32 (all of it written).
    launch_config overrides `_launch_config` (benchmark sweeps)."""
    _check(q, weights, key_cache, key_format, cand_slots, row_map, visible, out)
    T, H, D = q.shape
    R, E = cand_slots.shape
    if T == 0 or E == 0:
        return out
    heads_pad = max(16, triton.next_power_of_2(H))
    cfg = launch_config or _launch_config(row_map is not None and R < T, heads_pad)
    block_t, block_e, e_blocks = cfg["BLOCK_T"], cfg["BLOCK_E"], cfg["E_BLOCKS"]
    dot_dtype = _DOT_DTYPES[q.dtype]
    grid = (triton.cdiv(T, block_t), triton.cdiv(E, e_blocks * block_e))
    _dsv4_index_logits_kernel[grid](
        q, weights, key_cache, cand_slots, row_map if row_map is not None else visible, visible, out, T, E,
        q.stride(0), q.stride(1), weights.stride(0), key_cache.stride(0), cand_slots.stride(0), out.stride(0),
        NUM_HEADS=H, HEADS_PAD=heads_pad, HEAD_DIM=D, FORMAT=_FORMAT_ID[key_format], BLOCK_T=block_t,
        BLOCK_E=block_e, E_BLOCKS=e_blocks, HAS_ROW_MAP=row_map is not None, DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP4_GATHER=cfg["FP4_GATHER"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# ---------------------------------------------------------------------------------------------- reference


def _dequant_keys_ref(rows: torch.Tensor, key_format: str, dim: int) -> torch.Tensor:
    """Pool rows [..., width] -> keys [..., dim] fp32, decoding the byte layouts above."""
    if key_format == "dense":
        return rows.float()
    lead = rows.shape[:-1]
    if key_format == "fp8":
        nb = -(-dim // FP8_BLOCK)
        vals = rows[..., :dim].contiguous().view(torch.float8_e4m3fn).float()
        scale = rows[..., dim:dim + 4 * nb].contiguous().view(torch.float32)  # [..., nb]
        return vals * scale.repeat_interleave(FP8_BLOCK, dim=-1)[..., :dim]
    packed = rows[..., :dim // 2].to(torch.int32)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*lead, dim)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=rows.device)
    vals = torch.where(codes >= 8, -lut[codes & 7], lut[codes & 7])
    scale = (rows[..., dim // 2:].to(torch.int32) << 23).view(torch.float32)  # [..., dim/32]
    return vals * scale.repeat_interleave(FP4_BLOCK, dim=-1)


def dsv4_index_logits_ref(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, key_format: str,
                          cand_slots: torch.Tensor, row_map: Optional[torch.Tensor], visible: torch.Tensor,
                          out: torch.Tensor) -> torch.Tensor:
    """Torch reference (fp32): gathers each row block's keys, einsum, ReLU, head weights, -inf past visible."""
    _check(q, weights, key_cache, key_format, cand_slots, row_map, visible, out)
    T, H, D = q.shape
    E = cand_slots.shape[1]
    if T == 0 or E == 0:
        return out
    src = row_map if row_map is not None else torch.arange(T, device=q.device)
    e = torch.arange(E, device=q.device)
    step = max(1, _REF_GATHER_BYTES // (E * D * 4))
    for lo in range(0, T, step):
        hi = min(lo + step, T)
        keys = _dequant_keys_ref(key_cache[cand_slots[src[lo:hi]].clamp(min=0).long()], key_format, D)  # [t, E, D]
        scores = torch.einsum("thd,ted->the", q[lo:hi].float(), keys).relu()
        logits = torch.einsum("the,th->te", scores, weights[lo:hi].float())
        out[lo:hi] = logits.masked_fill(e[None, :] >= visible[lo:hi, None], float("-inf"))
    return out
