"""dsv4_sparse_attention: DeepSeek-V4 core attention over window + compressed KV entries, with the sink.

For query row t and head h (docs/dsv4-architecture.md 5.6), over the union J of its valid window keys
(`window_slots[t, :] >= 0`) and valid compressed entries (`extra_slots[r, j] >= 0` with r = extra_row_map[t]
and j < extra_len[t]), K = V (MQA, one shared 512-dim key/value head):

    s_j = softmax_scale * q_h . k_j                     M = max(max_j s_j, sink_h)
    o_h = sum_j exp(s_j - M) k_j / (sum_j exp(s_j - M) + exp(sink_h - M))      (0 when J is empty)

The sink is one extra logit with a zero value: it is only in the denominator (and is not scaled).
Caches are dense [N, D] (float32/bfloat16/float16) or, with `fp8_rope_dim = R > 0`, uint8 rows of the
"MODEL1_FP8Sparse" layout written by `dsv4_store_kv` (e4m3 nope * 2^(scale_byte - 127) per 64-block, bf16
rope), dequantized in the kernel.

Design (decode is the hot path: a few rows, 128 window + up to 8192 compressed keys each, H = 64, D = 512):
* One program = (row t, block of BH heads, key split s, value half). It streams its keys in blocks of BN: loads
  BN slots, gathers the BN key rows as two column halves (dequantizing FP8 in registers), computes
  S = Q_a K_a^T + Q_b K_b^T (tl.dot, [BH, D/2] x [D/2, BN] twice) and the online-softmax update
  acc = acc * alpha + P K ([BH, BN] x [BN, D/2]); the value tile is the key tile (K = V), so a key row is read
  from memory once per program.
* BH = 64 for H > 16 (all heads of a DeepSeek-V4 rank in one program): M = 64 lets sm_90 use wgmma with q and k
  from shared memory. The [64, 512] fp32 accumulator (128 registers a thread even over 8 warps) does not fit next
  to the rest, so with DV_SPLIT = 2 two programs share each (row, split), each accumulating one value half
  ([64, 256]) and both computing S: the MMA work grows 1.5x, which the H200 sweep found cheaper than the spills of
  one program holding all of D (the kernel is compute-bound: 4 H D = 131 kflop per 584-byte FP8 row, above the
  H200 ridge). Small H (TP shards, tests) use BH = 16 and DV_SPLIT = 1. See `_launch_config`.
* Split-K (flash-decoding): when rows x head blocks do not fill the GPU (batch 1-64 at H = 64), the key list
  (window then extra, one index space of W + K) is cut into `num_splits` contiguous chunks of >= 128 keys;
  each writes an unnormalized partial (acc [H, D], running max m, sum l; fp32) and a combine kernel merges
  them with the sink: M = max(m_s, sink), o = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + 2^(sink - M)).
  `num_splits` (None = `pick_num_splits`) is a runtime int: any value reuses the same compiled kernels.
* Scores are kept in the log2 domain (scale * log2 e folded into S, exp2). Dots run in bf16 for bf16 q with a
  bf16 cache, in fp16 for an FP8 cache with bf16 / fp16 q (e4m3 * 2^e is exact in fp16 but in tiny blocks; see
  `attention_dot_dtype`) and for fp16 q with an fp16 cache, else fp32 ("ieee"); softmax statistics and accumulators
  are fp32.
* FP8 caches load the key tile as static halves [0, D/2) and [D/2, D) (the first holds only nope dims: no rope
  loads, no select), so with DV_SPLIT = 2 the value half is chosen by a branch around the whole key loop.

Bytes moved (the roofline numerator, per call): q T*H*D*q.itemsize + keys sum_t |J_t| * row_bytes
(584 FP8 / 1024 bf16 for D = 512; invalid -1 keys are skipped by masking, not read) + slots
T*(W + K)*idx.itemsize + out T*H*D*out.itemsize; with splits add 2 * T*num_splits*H*(D + 2)*4 for the
partials (written then read back, mostly from L2). E.g. batch 1, HCA at 1M context, FP8: 8320 keys * 584 B
= 4.9 MB of keys; its 65 splits of 128 keys write 8.5 MB of partials, read back at once from the H200's 50 MB L2
(MIN_KEYS_PER_SPLIT trades that traffic against idle SMs; batch >= 132 rows runs without splits).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_attention_ref import check_sparse_attention_args, dsv4_sparse_attention_ref

_LOG2E = tl.constexpr(1.4426950408889634)
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for running maxima: exp2 of differences never makes NaN
MIN_KEYS_PER_SPLIT = 128  # a split smaller than this costs more in partial traffic than it gains
_COMBINE_BD, _COMBINE_BS = 128, 16  # combine: D columns and splits per program step


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _load_dense_cols(rows, valid, c0, D: tl.constexpr, NCOL: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Columns [c0, c0 + NCOL) of dense key rows at `rows` [BN] -> [BN, NCOL] in DOT_DTYPE (zeros for invalid rows
    and columns >= D)."""
    cols = c0 + tl.arange(0, NCOL)
    k = tl.load(rows[:, None] + cols[None, :], mask=valid[:, None] & (cols < D)[None, :], other=0.0)
    return k.to(tl.float32).to(DOT_DTYPE)  # explicit fp32 hop (a no-op pair when the dtypes already match)


@triton.jit
def _load_fp8_cols(rows, valid, C0: tl.constexpr, D: tl.constexpr, NCOL: tl.constexpr, ROPE: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, BN: tl.constexpr, LOADER: tl.constexpr):
    """Columns [C0, C0 + NCOL) of FP8 key rows at byte pointers `rows` [BN] -> [BN, NCOL] in DOT_DTYPE: e4m3 nope *
    2^(scale byte - 127) per 64 columns, bf16 rope (zeros for invalid rows and columns >= D). C0 is static, so a
    range inside the nope dims (D = 512: the first half) loads no rope and selects nothing.
    LOADER 0 reads the scale byte of every column (an L1 hit); 1 reads the NCOL / 64 scale bytes of each row once
    and broadcasts them over [BN, NCOL / 64, 64] (C0 is a multiple of 64).
    fp16 dots (see attention_dot_dtype): e4m3 -> fp16 is one instruction per pair and the power-of-two scale
    multiplies in fp16, exactly; fp32 dots (tests) dequantize in fp32."""
    cols = C0 + tl.arange(0, NCOL)
    NOPE: tl.constexpr = D - ROPE
    ALL_NOPE: tl.constexpr = C0 + NCOL <= NOPE
    CDT: tl.constexpr = tl.float16 if DOT_DTYPE == tl.float16 else tl.float32
    if ALL_NOPE:
        nope_mask = valid[:, None] & (cols >= 0)[None, :]  # the row mask, broadcast
    else:
        nope_mask = valid[:, None] & (cols < NOPE)[None, :]
    raw = tl.load(rows[:, None] + cols[None, :], mask=nope_mask, other=0)
    vals = raw.to(tl.float8e4nv, bitcast=True).to(CDT)
    if LOADER == 0:
        sbyte = tl.load(rows[:, None] + (NOPE + 2 * ROPE) + (cols // 64)[None, :], mask=nope_mask, other=0)
        nope = vals * (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(CDT)  # 2^(byte - 127); 0 -> 0
    else:
        NB: tl.constexpr = NCOL // 64
        blk = C0 // 64 + tl.arange(0, NB)
        sbyte = tl.load(rows[:, None] + (NOPE + 2 * ROPE) + blk[None, :],
                        mask=valid[:, None] & (blk < NOPE // 64)[None, :], other=0)
        scale = (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(CDT)
        nope = tl.reshape(tl.reshape(vals, [BN, NB, 64]) * scale[:, :, None], [BN, NCOL])
    if ALL_NOPE:
        k = nope
    else:
        rope_rows = (rows + NOPE).to(tl.pointer_type(tl.bfloat16))
        rope_mask = valid[:, None] & ((cols >= NOPE) & (cols < D))[None, :]
        rope = tl.load(rope_rows[:, None] + (cols - NOPE)[None, :], mask=rope_mask, other=0.0)
        k = tl.where((cols < NOPE)[None, :], nope, rope.to(tl.float32).to(CDT))
    return k.to(DOT_DTYPE)


@triton.jit
def _dot(a, b, acc, DOT_IEEE: tl.constexpr):
    if DOT_IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _attend(acc_a, acc_b, m_i, l_i, q_a, q_b, ca, cb, cache_ptr, slots_ptr, start, end, qk_scale,
            D: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr, ROW: tl.constexpr, BN: tl.constexpr,
            DV_SPLIT: tl.constexpr, OWN: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr,
            LOADER: tl.constexpr):
    """Online-softmax pass over list entries [start, end) of `slots_ptr` (log2-domain scores).

    The key tile is loaded as two column halves a and b, S = q_a k_a^T + q_b k_b^T. Dense caches: a = [ca, ca +
    HALF) is the program's value half, b = [cb, cb + HALF) the other (runtime offsets). FP8 caches: static halves a
    = [0, HALF), b = [HALF, 2 HALF) (q_a, q_b likewise), so the nope-only half loads no rope; OWN = 1 makes b the
    value half. acc_a gathers P k of the value half; acc_b gathers P k_b when this program owns both halves
    (DV_SPLIT = 1), else it is unused.
    """
    for j0 in range(start, end, BN):
        offs = j0 + tl.arange(0, BN)
        slot = tl.load(slots_ptr + offs, mask=offs < end, other=-1)
        valid = slot >= 0
        rows = cache_ptr + slot.to(tl.int64) * ROW
        if ROPE == 0:
            k_a = _load_dense_cols(rows, valid, ca, D, HALF, DOT_DTYPE)
            k_b = _load_dense_cols(rows, valid, cb, D, HALF, DOT_DTYPE)
        else:
            k_a = _load_fp8_cols(rows, valid, 0, D, HALF, ROPE, DOT_DTYPE, BN, LOADER)
            k_b = _load_fp8_cols(rows, valid, HALF, D, HALF, ROPE, DOT_DTYPE, BN, LOADER)
        s = _dot(q_a, tl.trans(k_a), tl.zeros([q_a.shape[0], BN], tl.float32), DOT_IEEE)
        s = _dot(q_b, tl.trans(k_b), s, DOT_IEEE)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(DOT_DTYPE)
        if OWN == 1:
            acc_a = _dot(p, k_b, acc_a * alpha[:, None], DOT_IEEE)
        else:
            acc_a = _dot(p, k_a, acc_a * alpha[:, None], DOT_IEEE)
        if DV_SPLIT == 1:
            acc_b = _dot(p, k_b, acc_b * alpha[:, None], DOT_IEEE)
        m_i = m_new
    return acc_a, acc_b, m_i, l_i


@triton.jit
def _attend_row(acc_a, acc_b, m_i, l_i, q_a, q_b, ca, cb, t, lo, hi, qk_scale, win_cache, win_slots, ext_cache,
                ext_slots, ext_row_map, ext_len, W, K, D: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr,
                ROW: tl.constexpr, BN: tl.constexpr, DV_SPLIT: tl.constexpr, OWN: tl.constexpr,
                DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr, LOADER: tl.constexpr, HAS_EXTRA: tl.constexpr,
                HAS_ROW_MAP: tl.constexpr, HAS_LEN: tl.constexpr):
    """Row t's keys at list indices [lo, hi): window keys [0, W), then compressed entries [W, W + K)."""
    acc_a, acc_b, m_i, l_i = _attend(acc_a, acc_b, m_i, l_i, q_a, q_b, ca, cb, win_cache,
                                     win_slots + t.to(tl.int64) * W, lo, tl.minimum(hi, W), qk_scale,
                                     D, HALF, ROPE, ROW, BN, DV_SPLIT, OWN, DOT_DTYPE, DOT_IEEE, LOADER)
    if HAS_EXTRA:  # compressed entries: list indices [lo - W, hi - W) of [0, min(K, extra_len[t]))
        r = t
        if HAS_ROW_MAP:
            r = tl.load(ext_row_map + t).to(tl.int32)
        n_ext = K
        if HAS_LEN:
            n_ext = tl.minimum(tl.load(ext_len + t).to(tl.int32), K)
        acc_a, acc_b, m_i, l_i = _attend(acc_a, acc_b, m_i, l_i, q_a, q_b, ca, cb, ext_cache,
                                         ext_slots + r.to(tl.int64) * K, tl.maximum(lo - W, 0),
                                         tl.minimum(hi - W, n_ext), qk_scale,
                                         D, HALF, ROPE, ROW, BN, DV_SPLIT, OWN, DOT_DTYPE, DOT_IEEE, LOADER)
    return acc_a, acc_b, m_i, l_i


@triton.jit
def _store_rows(ptr, heads, cols, hmask, D: tl.constexpr, stride_h, x):
    tl.store(ptr + heads[:, None] * stride_h + cols[None, :], x.to(ptr.dtype.element_ty),
             mask=hmask[:, None] & (cols < D)[None, :])


@triton.jit(do_not_specialize=["W", "K", "chunk", "num_splits"])
def _dsv4_sparse_attention_kernel(
    q_ptr, out_ptr, sink_ptr,
    win_cache, win_slots, ext_cache, ext_slots, ext_row_map, ext_len,
    acc_part, m_part, l_part,
    H, W, K, chunk, num_splits, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    D: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr, ROW: tl.constexpr,
    HAS_EXTRA: tl.constexpr, HAS_ROW_MAP: tl.constexpr, HAS_LEN: tl.constexpr, SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, DV_SPLIT: tl.constexpr,
    LOADER: tl.constexpr,
):
    # flat grid, (value half, head block) fastest: the programs sharing one (row, split) key range run side by side
    pid = tl.program_id(0)
    dh = pid % DV_SPLIT
    pid = pid // DV_SPLIT
    num_hb = tl.cdiv(H, BH)
    hb = pid % num_hb
    rest = pid // num_hb  # = t * num_splits + split
    split = rest % num_splits
    t = rest // num_splits
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < H
    ca = dh * HALF  # the value half this program outputs (DV_SPLIT = 1: both, a then b)
    cb = (1 - dh) * HALF if DV_SPLIT == 2 else HALF
    cols_a = ca + tl.arange(0, HALF)
    cols_b = cb + tl.arange(0, HALF)
    q_rows = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    if ROPE == 0:  # q halves as the key halves _attend loads (static lo / hi for FP8 caches)
        qc_a, qc_b = cols_a, cols_b
    else:
        qc_a, qc_b = tl.arange(0, HALF), HALF + tl.arange(0, HALF)
    q_a = tl.load(q_rows + qc_a[None, :], mask=hmask[:, None] & (qc_a < D)[None, :], other=0.0)
    q_b = tl.load(q_rows + qc_b[None, :], mask=hmask[:, None] & (qc_b < D)[None, :], other=0.0)
    q_a = q_a.to(tl.float32).to(DOT_DTYPE)
    q_b = q_b.to(tl.float32).to(DOT_DTYPE)
    m_i = tl.full([BH], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc_a = tl.zeros([BH, HALF], tl.float32)
    acc_b = tl.zeros([BH, HALF if DV_SPLIT == 1 else 16], tl.float32)  # unused with DV_SPLIT = 2
    lo = split * chunk
    hi = lo + chunk
    if ROPE > 0 and DV_SPLIT == 2:  # FP8: the value half is static inside the key loop, one loop per half
        if dh == 1:
            acc_a, acc_b, m_i, l_i = _attend_row(acc_a, acc_b, m_i, l_i, q_a, q_b, ca, cb, t, lo, hi, qk_scale,
                                                 win_cache, win_slots, ext_cache, ext_slots, ext_row_map, ext_len, W,
                                                 K, D, HALF, ROPE, ROW, BN, DV_SPLIT, 1, DOT_DTYPE, DOT_IEEE, LOADER,
                                                 HAS_EXTRA, HAS_ROW_MAP, HAS_LEN)
        else:
            acc_a, acc_b, m_i, l_i = _attend_row(acc_a, acc_b, m_i, l_i, q_a, q_b, ca, cb, t, lo, hi, qk_scale,
                                                 win_cache, win_slots, ext_cache, ext_slots, ext_row_map, ext_len, W,
                                                 K, D, HALF, ROPE, ROW, BN, DV_SPLIT, 0, DOT_DTYPE, DOT_IEEE, LOADER,
                                                 HAS_EXTRA, HAS_ROW_MAP, HAS_LEN)
    else:
        acc_a, acc_b, m_i, l_i = _attend_row(acc_a, acc_b, m_i, l_i, q_a, q_b, ca, cb, t, lo, hi, qk_scale,
                                             win_cache, win_slots, ext_cache, ext_slots, ext_row_map, ext_len, W, K,
                                             D, HALF, ROPE, ROW, BN, DV_SPLIT, 0, DOT_DTYPE, DOT_IEEE, LOADER,
                                             HAS_EXTRA, HAS_ROW_MAP, HAS_LEN)
    if SPLIT:
        base = rest.to(tl.int64) * H + heads  # partial index (t * num_splits + split) * H + h
        if dh == 0:  # both value halves computed the same statistics
            tl.store(m_part + base, m_i, mask=hmask)
            tl.store(l_part + base, l_i, mask=hmask)
        # a split whose keys were all past the row's entries (l = 0: acc is 0) writes no values and the combine
        # reads none: a decode graph sizes its splits for the context capacity, most of them empty at short contexts
        part = acc_part + rest.to(tl.int64) * H * D
        _store_rows(part, heads, cols_a, hmask & (l_i > 0), D, D, acc_a)
        if DV_SPLIT == 1:
            _store_rows(part, heads, cols_b, hmask & (l_i > 0), D, D, acc_b)
    else:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * _LOG2E
        m_all = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - m_all)
        inv = keep / (l_i * keep + tl.exp2(sink - m_all))
        o_rows = out_ptr + t.to(tl.int64) * stride_ot
        _store_rows(o_rows, heads, cols_a, hmask, D, stride_oh, acc_a * inv[:, None])
        if DV_SPLIT == 1:
            _store_rows(o_rows, heads, cols_b, hmask, D, stride_oh, acc_b * inv[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _dsv4_attention_combine_kernel(
    acc_part, m_part, l_part, sink_ptr, out_ptr, H, num_splits, stride_ot, stride_oh,
    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
):
    pid = tl.program_id(0)
    num_db = tl.cdiv(D, BD)
    db = pid % num_db
    rest = pid // num_db  # = t * H + h
    h = rest % H
    t = rest // H
    cols = db * BD + tl.arange(0, BD)
    cmask = cols < D
    sink = tl.load(sink_ptr + h).to(tl.float32) * _LOG2E
    m_all = sink
    for s0 in range(0, num_splits, BS):
        s = s0 + tl.arange(0, BS)
        m = tl.load(m_part + (t.to(tl.int64) * num_splits + s) * H + h, mask=s < num_splits, other=_NEG_BIG)
        m_all = tl.maximum(m_all, tl.max(m, axis=0))
    den = tl.exp2(sink - m_all)
    num = tl.zeros([BD], tl.float32)
    for s0 in range(0, num_splits, BS):
        s = s0 + tl.arange(0, BS)
        smask = s < num_splits
        idx = (t.to(tl.int64) * num_splits + s) * H + h
        m = tl.load(m_part + idx, mask=smask, other=_NEG_BIG)
        w = tl.exp2(m - m_all)
        l = tl.load(l_part + idx, mask=smask, other=0.0)
        den += tl.sum(l * w, axis=0)
        # an empty split (l = 0) wrote no values: they are 0, not read
        a = tl.load(acc_part + idx[:, None] * D + cols[None, :], mask=(smask & (l > 0))[:, None] & cmask[None, :],
                    other=0.0)
        num += tl.sum(a * w[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + cols, (num / den).to(out_ptr.dtype.element_ty),
             mask=cmask)


# ----------------------------------------------------------------------------- launch


def _launch_config(num_heads: int, dot_dtype) -> dict:
    """Static launch settings, keyed on the head count and dot dtype only (never on token or key counts).

    BH: heads per program (64 = every head of a DeepSeek-V4 rank: each key is gathered and dequantized once per
    row; 16 for small H). BN: keys per step. DV_SPLIT: programs sharing one (row, head block), each owning half of
    the value columns (half the accumulator registers, at the cost of computing S and dequantizing twice).
    LOADER 1: one scale byte per 64 columns, broadcast (LOADER 0, a scale byte per column, makes Triton pick
    byte-wise uncoalesced gathers). From the H200 sweep (benchmark/kernels/sweep_dsv4.py, benchmark/RESULTS.md):
    at H = 64, D = 512, FP8, BH 64 / BN 32 / DV_SPLIT 2 / 4 warps / 1 stage is the fastest of 23 tilings (2.4x the
    BN 16 / DV_SPLIT 1 / 8 warps of before at batch 128); every tiling still spills (255 registers: the [64, 256]
    fp32 accumulator is 128 a thread). fp32 dots (tests, fp32 models) are FMA loops: keep them small.
    """
    if dot_dtype == tl.float32:
        return dict(BH=16, BN=16, DV_SPLIT=1, LOADER=1, num_warps=4, num_stages=1)
    if num_heads > 16:
        return dict(BH=64, BN=32, DV_SPLIT=2, LOADER=1, num_warps=4, num_stages=1)
    return dict(BH=16, BN=32, DV_SPLIT=1, LOADER=1, num_warps=8, num_stages=2)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H200 / H100 SXM: CPU runs (the interpreter) pick the same splits as the target GPU


def _programs(num_rows: int, num_heads: int, block_heads: int, dv_split: int) -> int:
    """Programs of one key split: rows x head blocks x value halves."""
    return num_rows * triton.cdiv(num_heads, block_heads) * dv_split


def pick_num_splits(num_rows: int, num_heads: int, num_keys: int, device: torch.device, block_heads: int = 64,
                    dv_split: int = 1) -> int:
    """Key splits so that rows x head blocks x splits fills about one wave of SMs, each split >= 128 keys.

    Depends on the row count, so outputs may differ in the last bits between batch sizes; pass
    `num_splits` explicitly for batch-invariant results. The value is a runtime argument (no recompile).
    """
    programs = _programs(num_rows, num_heads, block_heads, dv_split)
    sms = _sm_count(device)
    if num_keys <= MIN_KEYS_PER_SPLIT or programs >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, programs), triton.cdiv(num_keys, MIN_KEYS_PER_SPLIT)))


def launch_variant(num_rows: int, num_heads: int, dot_dtype, num_sms: int) -> tuple:
    """What the compiled kernels of a launch of `num_rows` rows depend on besides integer divisibility: the static
    launch settings and whether its keys may be split (the SPLIT variant and the combine kernel: only where one
    split's programs leave SMs idle, as pick_num_splits decides; a launch with few keys does not split either). The
    server's warm-up plans its prompts from this."""
    cfg = _launch_config(num_heads, dot_dtype)
    may_split = _programs(num_rows, num_heads, cfg["BH"], cfg["DV_SPLIT"]) < num_sms
    return tuple(sorted(cfg.items())), may_split


def attention_dot_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype, fp8: bool):
    """(triton dtype of the tl.dot inputs, use ieee fp32) for q and the cache's key dtype.

    An FP8 cache with bf16 or fp16 q dots in fp16: a dequantized key (an e4m3 value, 4 significant bits, times its
    64-block's power of two 2^-22 .. ) is exact in fp16 as in bf16 wherever the block's amax >= 448 * 2^-16 (6.8e-3;
    in smaller blocks elements below 2^-14 round to fp16's 2^-24 grid, an absolute error under 3e-8), q (per-head
    RMS-normed, |q| <= sqrt(D)) and the softmax weights P in [0, 1] keep 3 more bits than in bf16, and e4m3 -> fp16
    is one instruction per pair where bf16 needs four (via fp32): the FP8 prefill ran 1.5x the bf16 cache's
    attention time before (RESULTS.md, 2026-12-04). Assumed: keys within fp16's range (|k| < 65504; DeepSeek-V4's KV
    is RMS-normed, O(1-100)); P below 2^-24 of the running maximum rounds to 0 (a relative error under 1e-4 even over
    thousands of keys)."""
    if fp8 and q_dtype in (torch.bfloat16, torch.float16):
        return tl.float16, False
    if q_dtype == torch.bfloat16 and cache_dtype == torch.bfloat16:
        return tl.bfloat16, False
    if q_dtype == torch.float16 and cache_dtype == torch.float16:
        return tl.float16, False
    return tl.float32, True


def dsv4_sparse_attention(q, window_cache, window_slots, extra_cache=None, extra_slots=None, extra_row_map=None,
                          extra_len=None, sink=None, softmax_scale=None, fp8_rope_dim=0, out=None,
                          num_splits=None, launch_config=None) -> torch.Tensor:
    """Attention of q [T, H, D] over window keys + compressed entries with the sink; returns [T, H, D] (q.dtype).

    window_slots [T, W] / extra_slots [R, K] (int32/int64, -1 = no key) index rows of window_cache /
    extra_cache. extra_row_map [T] picks the list row of each query row (None: row t uses list t);
    extra_len [T] limits row t to the first extra_len[t] entries (None: all). sink [H] (fp32 logits).
    fp8_rope_dim > 0 selects the FP8 cache layout. num_splits: key splits (None: `pick_num_splits`).
    launch_config: overrides `_launch_config` (benchmark sweeps).
    """
    check_sparse_attention_args(q, window_cache, window_slots, extra_cache, extra_slots, extra_row_map, extra_len,
                                sink, softmax_scale, fp8_rope_dim, out)
    t, h, d = q.shape
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    rope = max(fp8_rope_dim, 0)
    has_extra = extra_slots is not None and extra_slots.shape[1] > 0
    w = window_slots.shape[1]
    k = extra_slots.shape[1] if has_extra else 0
    half = triton.next_power_of_2(max(d, 64)) // 2  # the key tile is loaded as two column halves
    dot_dtype, dot_ieee = attention_dot_dtype(q.dtype, window_cache.dtype, rope > 0)
    cfg = launch_config or _launch_config(h, dot_dtype)
    bh, bn, dv_split = cfg["BH"], cfg["BN"], cfg["DV_SPLIT"]
    assert dv_split in (1, 2), f"DV_SPLIT must be 1 or 2, got {dv_split}"
    splits = num_splits if num_splits is not None else pick_num_splits(t, h, w + k, q.device, bh, dv_split)
    chunk = triton.cdiv(triton.cdiv(max(w + k, 1), max(splits, 1)), bn) * bn
    splits = triton.cdiv(max(w + k, 1), chunk)
    if splits > 1:
        acc_part = torch.empty(t * splits * h * d, dtype=torch.float32, device=q.device)
        m_part = torch.empty(t * splits * h, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
    else:
        acc_part = m_part = l_part = out  # unused
    grid = (t * splits * triton.cdiv(h, bh) * dv_split,)
    _dsv4_sparse_attention_kernel[grid](
        q, out, sink, window_cache, window_slots,
        extra_cache if has_extra else window_cache, extra_slots if has_extra else window_slots,
        extra_row_map if extra_row_map is not None else window_slots,
        extra_len if extra_len is not None else window_slots,
        acc_part, m_part, l_part,
        h, w, k, chunk, splits, softmax_scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        D=d, HALF=half, ROPE=rope, ROW=window_cache.shape[1],
        HAS_EXTRA=has_extra, HAS_ROW_MAP=has_extra and extra_row_map is not None,
        HAS_LEN=has_extra and extra_len is not None, SPLIT=splits > 1,
        DOT_DTYPE=dot_dtype, DOT_IEEE=dot_ieee, BH=bh, BN=bn, DV_SPLIT=dv_split,
        LOADER=cfg.get("LOADER", 0) if half >= 64 else 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        bd = min(_COMBINE_BD, triton.next_power_of_2(d))
        _dsv4_attention_combine_kernel[(t * h * triton.cdiv(d, bd),)](
            acc_part, m_part, l_part, sink, out, h, splits, out.stride(0), out.stride(1),
            D=d, BD=bd, BS=_COMBINE_BS, num_warps=4,
        )
    return out


__all__ = ["dsv4_sparse_attention", "dsv4_sparse_attention_ref", "pick_num_splits"]
