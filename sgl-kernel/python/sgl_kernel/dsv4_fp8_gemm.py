"""dsv4_fp8_linear: y = x @ W.T with W in FP8 e4m3 and one power-of-two multiplier per 128x128 block, grouped.

Two launches: `dsv4_fp8_act_quant` quantizes the activations per token and 128 channels (power-of-two scales from
the bits of amax, as the hub's dynamic ue8m0 scheme; dsv4_fp8_gemm_ref.py is the reference), then
`dsv4_fp8_block_gemm` runs the FP8 MMA per 128-wide K step and applies both scales to the fp32 partial sums. Where FP8
MMA is missing (pre-Hopper NVIDIA, or a caller's choice), `quantize_act=False` runs W8A16: the weight tile is
converted to the activation dtype in registers and only its scale applied.

Split-K: at decode rows the output tiles are too few to fill the GPU, so K is split (`_splits`: tiles x splits about
a configuration's programs per SM, two by default). Launch configurations (`_config`): a rule by rows, or for W8A8
the measured winner per (shape, row tier) listed in FP8_GEMM_TUNED (benchmark/kernels/sweep_fp8_decode.py). Each
split stores its fp32 partial tile to a workspace and counts itself on the tile's int32 counter (release); the tile's
last split (acquire) adds the partials in split order and stores the sum in the output dtype, then puts the counter
back to zero. One launch, deterministic, and bit for bit what a GEMM writing the partials followed by a summing
kernel gives. The counters (`_tile_counters`) are allocated once per device; launches sharing a
device must run one after another (one stream), as the engine's do.

Groups: x [M, G * K] and W [G * N, K]; output columns [g * N, (g + 1) * N) are x[:, g] @ W[g * N:(g + 1) * N].T, each
group's activations quantized on their own. G = 1 is a plain linear; DeepSeek-V4's grouped low-rank output
projection `wo_a` uses G = o_groups. Weight-scale rows are looked up by absolute weight row, so N need not be a
multiple of 128; partial K blocks are masked.

`dsv4_fp8_dequant` writes the dequantized weight in one pass (for a vendor GEMM on it: torch's convert-then-scale
took ~10x the copy time at Flash shapes on an H200).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_fp8_gemm_ref import BLOCK, FP8_DTYPES, fp8_max
from sgl_kernel.dsv4_target import dot_precision, lds_limit


@triton.jit
def fp8_block_scale(amax, FP8_MAX: tl.constexpr):
    """Per row of a 128-channel block, from its amax (fp32 >= 0): (the power-of-two multiplier 2^e, its inverse), e
    the smallest with amax / 2^e <= FP8_MAX (from amax's bits, exact; at least -126). FP8_MAX: 448 (e4m3fn) or 240
    (e4m3fnuz), the output dtype's (dsv4_fp8_gemm_ref.fp8_max)."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    if FP8_MAX == 448.0:
        e = exponent - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # amax / (1.75 * 2^8) <= 2^e
    else:
        tl.static_assert(FP8_MAX == 240.0, "FP8_MAX is e4m3fn's 448 or e4m3fnuz's 240")
        e = exponent - 7 + ((bits & 0x7FFFFF) > 0x700000).to(tl.int32)  # amax / (1.875 * 2^7) <= 2^e
    e = tl.maximum(e, -126)
    return ((e + 127) << 23).to(tl.float32, bitcast=True), ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_codes(x, inv, FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """fp32 x times its row's inverse multiplier `inv` (broadcast by the caller), clamped to +-FP8_MAX: the e4m3
    values, still fp32, for the caller to cast."""
    q = tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX)  # exact: inv is a power of two
    if ROUND_IN_FP32:
        # The CPU interpreter's fp8 conversion does not round to nearest: round to the nearest e4m3 value (ties to
        # even) in fp32 first, so the cast only re-encodes an exact value. The spacing at q is 2^(max(E, emin) - 3)
        # (emin, the smallest normal exponent: -6 for e4m3fn, -7 for e4m3fnuz); y = q / spacing has |y| < 16, and
        # (y + 1.5 * 2^23) - 1.5 * 2^23 rounds it to an integer the IEEE way. (GPUs convert with
        # round-to-nearest-even, saturating: the plain cast.)
        qe = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        if FP8_MAX == 448.0:
            ue = tl.maximum(qe, -6) - 3
        else:
            ue = tl.maximum(qe, -7) - 3
        y = q * ((127 - ue) << 23).to(tl.float32, bitcast=True)
        y = (y + 12582912.0) - 12582912.0
        q = y * ((ue + 127) << 23).to(tl.float32, bitcast=True)
    if FP8_MAX != 448.0:
        q = tl.where(q == 0.0, 0.0, q)  # e4m3fnuz has no -0: its code 0x80 is NaN; a rounded-away negative is +0
    return q


@triton.jit
def quantize_rows(x, FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """fp32 rows [R, 128] of one 128-channel block -> (their e4m3 values, still fp32, for the caller to cast; the
    multipliers [R]). Shared by the act-quant kernel and the producers that quantize their own output (RMSNorm, the
    inverse RoPE), so all compute one function."""
    scale, inv = fp8_block_scale(tl.max(tl.abs(x), axis=1), FP8_MAX)
    return fp8_codes(x, inv[:, None], FP8_MAX, ROUND_IN_FP32), scale


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, KB, stride_x, stride_q, stride_s, stride_sc,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
                      ROUND_IN_FP32: tl.constexpr):
    """One 128-channel block of BLOCK_M rows (quantize_rows)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1) // KB
    b = tl.program_id(1) % KB
    k = b * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (k[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_x + g * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_rows(x, FP8_MAX, ROUND_IN_FP32)
    tl.store(q_ptr + rows[:, None] * stride_q + g * K + k[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_s + (g * KB + b) * stride_sc, scale, mask=rows < M)


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, KB, SPLITS,
                           KB_PER_SPLIT, stride_am, stride_as, stride_wn, stride_ws, stride_om, stride_pm, stride_ps,
                           QUANT_A: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, SPLIT_K: tl.constexpr,
                           LAST_REDUCES: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of group g over K blocks [split * KB_PER_SPLIT, ...). Without SPLIT_K the one
    split stores its tile to out. SPLIT_K (few rows leave too few tiles to fill the GPU): each split stores its fp32
    partial sums to its own slice of part [SPLITS, M, G * N]; with LAST_REDUCES the tile's last split to finish
    (counted in cnt_ptr, one int32 per output tile, zero between launches) adds the SPLITS slices in split order,
    stores the sum to out in out's dtype and puts the count back to zero (a two-launch GEMM + sum, bit for bit, in
    one launch). TMA: the weight tiles through the tensor descriptor `w_desc` over w [G * N, K] (no per-element
    address registers; copies the compiler can pipeline); tile rows past this group's N only reach masked outputs,
    K past the weight reads zeros."""
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    g = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    kb_lo = split * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, KB)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    w_row = (g * N + rn).to(tl.int64)  # absolute weight row: its scale row is w_row // 128
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + g * K + kb_lo * BLOCK_K + rk[None, :]
    w_ptrs = w_ptr + w_row[None, :] * stride_wn + kb_lo * BLOCK_K + rk[:, None]  # [BLOCK_K, BLOCK_N], W transposed
    ws_ptrs = ws_ptr + (w_row // BLOCK_K) * stride_ws
    as_ptrs = as_ptr + rm.to(tl.int64) * stride_as + g * KB
    cnt = cnt_ptr + (g * tl.num_programs(1) + pid_m) * tl.num_programs(0) + pid_n  # this output tile's counter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k_ok = kb * BLOCK_K + rk < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if TMA:
            w = tl.trans(w_desc.load([g * N + pid_n * BLOCK_N, kb * BLOCK_K]))
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sw = tl.load(ws_ptrs + kb, mask=n_ok, other=0.0)
        if QUANT_A:
            sa = tl.load(as_ptrs + kb, mask=m_ok, other=0.0)
            acc += tl.dot(a, w, out_dtype=tl.float32) * sa[:, None] * sw[None, :]
        else:
            acc += tl.dot(a, w.to(a.dtype), out_dtype=tl.float32, input_precision=PREC) * sw[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    ok = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + g * N + rn[None, :]
    if SPLIT_K:
        parts = part_ptr + rm.to(tl.int64)[:, None] * stride_pm + g * N + rn[None, :]
        tl.store(parts + split.to(tl.int64) * stride_ps, acc, mask=ok)
        if LAST_REDUCES:
            tl.debug_barrier()  # every thread's partial stored before the count releases them
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
            if arrived == SPLITS - 1:  # the other splits' partials are visible (acquire): add them from L2 in order
                total = tl.load(parts, mask=ok, other=0.0, cache_modifier=".cg")
                for _ in range(1, SPLITS):
                    parts += stride_ps  # pointer steps: 64-bit offsets
                    total += tl.load(parts, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=ok)
                tl.store(cnt, 0)  # every split has counted: the next launch (or graph replay) starts at 0
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s, stride_o, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile: e4m3 codes times their 128x128 block's multiplier, in the output dtype."""
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (rn // 128)[:, None] * stride_s + (rk // 128)[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rn[:, None] * stride_o + rk[None, :], (w * s).to(out_ptr.dtype.element_ty), mask=mask)


def dsv4_fp8_dequant(w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e4m3 [N, K] with multipliers [ceil(N / 128), ceil(K / 128)] -> [N, K] in `dtype`, one pass (exact for bf16 /
    fp16 / fp32 outputs in range: an e4m3 value times a power of two)."""
    n, k = w.shape
    if tuple(w_scale.shape) != (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)) or w.stride(1) != 1:
        raise ValueError(f"weight {tuple(w.shape)} / scale {tuple(w_scale.shape)}: not an FP8 block-scaled weight")
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    if n and k:
        _dequant_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](
            w, w_scale, out, n, k, w.stride(0), w_scale.stride(0), out.stride(0), BLOCK_N=32, BLOCK_K=256,
            num_warps=4)
    return out


def _rows(x: torch.Tensor, groups: int) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % groups:
        raise ValueError(f"x must be [M, groups * K] with contiguous rows, got {tuple(x.shape)} "
                         f"stride {x.stride()} for {groups} groups")
    return x


CUBLAS_ROW_PAD = 16  # rows of the cuBLAS layout: a multiple of this (fp8_act_buffers)


def fp8_act_buffers(m: int, width: int, blocks: int, cublas_layout: bool, device: torch.device,
                    dtype: torch.dtype = torch.float8_e4m3fn) -> tuple:
    """Empty (e4m3 [M, width] in `dtype`, the FP8 weight's: float8_e4m3fn, or float8_e4m3fnuz on gfx942; fp32
    multipliers [M, blocks]) for M activation rows quantized per 128 channels.
    cublas_layout: what cuBLAS's blockwise-scaled GEMM takes (torch._scaled_mm): rows padded (the padding already
    zero, its multipliers 1), the multipliers outer-dim major (stride (1, padded M)). cuBLAS needs a multiple of 4;
    the rows go to a multiple of CUBLAS_ROW_PAD = 16, so that the kernels writing these buffers, which take that
    stride as an argument, always see it divisible by 16: with 4, a prefill chunk whose padded rows were not
    compiled a variant of five kernels inside a served request (2.4 s on an H100)."""
    rows = m + (-m % CUBLAS_ROW_PAD if cublas_layout else 0)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"FP8 activations are float8_e4m3fn or float8_e4m3fnuz, not {dtype}")
    q = torch.empty(rows, width, dtype=dtype, device=device)
    if cublas_layout:
        s = torch.empty(blocks, rows, dtype=torch.float32, device=device).t()
        if rows > m:
            q[m:].zero_()
            s[m:].fill_(1.0)
    else:
        s = torch.empty(m, blocks, dtype=torch.float32, device=device)
    return q, s


def dsv4_fp8_act_quant(x: torch.Tensor, groups: int = 1, cublas_layout: bool = False,
                       dtype: torch.dtype = torch.float8_e4m3fn) -> tuple:
    """x [M, G * K] -> (e4m3 [M, G * K] in `dtype`, fp32 power-of-two multipliers [M, G * ceil(K / 128)]), in the
    cuBLAS layout if asked (fp8_act_buffers)."""
    x = _rows(x, groups)
    m, k = x.shape[0], x.shape[1] // groups
    kb = triton.cdiv(k, BLOCK)
    q, s = fp8_act_buffers(m, x.shape[1], groups * kb, cublas_layout, x.device, dtype)
    if m and k:
        # 16 rows per program: one row of 128 channels per program made this launch-bound (2.5x the cuBLAS GEMM it
        # feeds at Flash's prefill shapes on an H200)
        _act_quant_kernel[(triton.cdiv(m, 16), groups * kb)](
            x, q, s, m, k, kb, x.stride(0), q.stride(0), s.stride(0), s.stride(1), BLOCK_M=16, BLOCK_K=BLOCK,
            FP8_MAX=fp8_max(dtype), ROUND_IN_FP32=x.device.type != "cuda")
    return q, s


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch configuration of _fp8_block_gemm_kernel (BLOCK_K is always the weight's 128-wide scale block)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # K splits so that output tiles x splits reach about this many programs per SM (at least 2 K blocks a split);
    # 0: one split (enough row tiles)
    programs_per_sm: int = 2
    # weight tiles through a TMA descriptor where the weight and device allow it (a contiguous weight, K a multiple of
    # 16, sm90+), else pointer loads
    tma: bool = False


@dataclass(frozen=True)
class Fp8GemmTuned:
    """A measured configuration (benchmark/kernels/sweep_fp8_decode.py prints its winners in this form) for the W8A8
    launches of an [n, k] weight per group, `groups` groups, at rows up to `rows` (a ROW_TIERS tier) and above the
    tier below it. Results depend on the configuration (its K splits set the fp32 summation order, its tile the MMA
    instruction), so a shape's rows always get the same one: keyed by (shape, tier) alone."""
    n: int
    k: int
    groups: int
    rows: int
    config: Fp8GemmConfig


# row tiers of the tuned table (decode batch 1, small batches, verify; 64: the most rows every FP8 linear runs
# here in the engine, wo_a's graphs up to 128)
ROW_TIERS = (1, 8, 32, 64, 128)

# Measured winners (sweep_fp8_decode.py --table); a (shape, tier) not listed keeps _default_config. Empty: the rule.
FP8_GEMM_TUNED: tuple = (  # sweep_fp8_decode.py, NVIDIA H100 80GB HBM3: gain, fraction of copy bandwidth
    Fp8GemmTuned(1536, 4096, 1, 1, Fp8GemmConfig(16, 64, 4, 3, 2, False)),  # wq_kv_a: 1.04x, 0.31
    Fp8GemmTuned(1536, 4096, 1, 8, Fp8GemmConfig(16, 32, 4, 4, 2, False)),  # wq_kv_a: 1.06x, 0.30
    Fp8GemmTuned(1536, 4096, 1, 32, Fp8GemmConfig(32, 32, 2, 3, 2, False)),  # wq_kv_a: 1.31x, 0.28
    Fp8GemmTuned(1024, 4096, 8, 32, Fp8GemmConfig(32, 64, 2, 4, 1, True)),  # wo_a: 1.04x, 0.66
    Fp8GemmTuned(1024, 4096, 8, 128, Fp8GemmConfig(64, 64, 4, 4, 0, True)),  # wo_a: 1.48x, 0.64
    Fp8GemmTuned(4096, 4096, 1, 32, Fp8GemmConfig(32, 32, 2, 3, 2, False)),  # shared_w13: 1.10x, 0.52
    Fp8GemmTuned(4096, 2048, 1, 8, Fp8GemmConfig(16, 32, 4, 4, 2, False)),  # shared_w2: 1.08x, 0.41
    Fp8GemmTuned(4096, 2048, 1, 32, Fp8GemmConfig(32, 32, 2, 4, 1, False)),  # shared_w2: 1.14x, 0.39
)

_TUNED_INDEX: list = [None, {}]  # [the FP8_GEMM_TUNED indexed, {(n, k, groups, rows): config}]


def _row_tier(m: int) -> Optional[int]:
    return next((tier for tier in ROW_TIERS if m <= tier), None)


def _tuned_config(n: int, k: int, groups: int, m: int) -> Optional[Fp8GemmConfig]:
    """FP8_GEMM_TUNED's configuration for this shape at m rows' tier, if listed (indexed again when replaced)."""
    if _TUNED_INDEX[0] is not FP8_GEMM_TUNED:
        index = {}
        for entry in FP8_GEMM_TUNED:
            if entry.rows not in ROW_TIERS:
                raise ValueError(f"{entry}: rows must be a tier of {ROW_TIERS}")
            index[(entry.n, entry.k, entry.groups, entry.rows)] = entry.config
        _TUNED_INDEX[:] = [FP8_GEMM_TUNED, index]
    tier = _row_tier(m)
    return None if tier is None else _TUNED_INDEX[1].get((n, k, groups, tier))


def _default_config(m: int, a_bytes: int) -> Fp8GemmConfig:
    """By row count: skinny decode tiles spread the weight over many programs (and K splits); prefill tiles reuse it.
    fp32 activation tiles (W8A16 in fp32) take fewer pipeline stages, so the staged tiles fit in shared memory (4
    stages of 64 x 128 fp32 rows need 311 KB on an H200, which has 227 KB)."""
    if m <= 16:
        return Fp8GemmConfig(16, 64, 4, 4)
    if m <= 64:
        return Fp8GemmConfig(64, 64, 4, 4 if a_bytes < 4 else 2)
    return Fp8GemmConfig(128, 128, 8, 3 if a_bytes < 4 else 1, programs_per_sm=0)


def _config(m: int, a_bytes: int, n: int = 0, k: int = 0, groups: int = 1) -> Fp8GemmConfig:
    """The launch configuration of m rows through `groups` x [n, k]: the tuned table's for W8A8 (FP8 activations,
    what it measured), else _default_config."""
    tuned = _tuned_config(n, k, groups, m) if a_bytes == 1 else None
    return tuned or _default_config(m, a_bytes)


def hip_config(cfg: Fp8GemmConfig, a_bytes: int, lds: int) -> Fp8GemmConfig:
    """A configuration for a ROCm device with `lds` bytes of LDS a workgroup: no TMA; at most 2 stages where the
    staged tiles (activations and weights, BLOCK_K wide) would not fit 2 - 1 LDS buffers (Triton's AMD pipeliner holds
    stages - 1 of them: 64 x 64 bf16 W8A16 tiles at 4 stages took 72 KiB on gfx942), then N tiles halved until they
    fit. The NVIDIA tuning (FP8_GEMM_TUNED) is kept where it fits: no AMD measurement replaces it yet."""
    stages, block_n = cfg.num_stages, cfg.block_n

    def staged(stages: int, block_n: int) -> int:
        return max(stages - 1, 1) * BLOCK * (cfg.block_m * a_bytes + block_n)

    while stages > 2 and staged(stages, block_n) > lds:
        stages -= 1
    while block_n > 16 and staged(stages, block_n) > lds:
        block_n //= 2
    return replace(cfg, num_stages=stages, block_n=block_n, tma=False)


def dsv4_fp8_block_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int = 1,
                        out_dtype: torch.dtype = torch.bfloat16, quantize_act: bool = True,
                        tma: Optional[bool] = None) -> torch.Tensor:
    """x [M, G * K] (bf16/fp16/fp32), w e4m3 (fn or fnuz) [G * N, K], w_scale fp32 [ceil(G * N / 128), ceil(K / 128)] ->
    [M, G * N] in out_dtype. quantize_act: W8A8 (FP8 MMA); else W8A16 (x's dtype MMA). tma: the weight tiles
    through a TMA descriptor (K a multiple of 16) or not; None: as the launch configuration (_config) says."""
    x = _rows(x, groups)
    k = x.shape[1] // groups
    n = w.shape[0] // groups
    kb = triton.cdiv(k, BLOCK)
    if w.shape[1] != k or w.shape[0] != groups * n or tuple(w_scale.shape) != (triton.cdiv(w.shape[0], BLOCK), kb):
        raise ValueError(f"weight {tuple(w.shape)} / scale {tuple(w_scale.shape)} do not fit x {tuple(x.shape)} "
                         f"in {groups} groups")
    if quantize_act:  # to the weight's e4m3 encoding: the FP8 MMA takes two of one kind
        a, a_scale = dsv4_fp8_act_quant(x, groups, dtype=w.dtype)
        return dsv4_fp8_scaled_gemm(a, a_scale, w, w_scale, groups, out_dtype, tma=tma)
    return _launch(x, None, w, w_scale, groups, out_dtype, tma=tma)


def dsv4_fp8_scaled_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         groups: int = 1, out_dtype: torch.dtype = torch.bfloat16,
                         tma: Optional[bool] = None) -> torch.Tensor:
    """The GEMM of already quantized activations: a e4m3 [M, G * K] with a_scale fp32 [M, G * ceil(K / 128)]."""
    if a_scale.shape != (a.shape[0], groups * triton.cdiv(a.shape[1] // groups, BLOCK)) or a_scale.stride(1) != 1:
        raise ValueError(f"activation scale {tuple(a_scale.shape)} does not fit {tuple(a.shape)} in {groups} groups")
    return _launch(a, a_scale, w, w_scale, groups, out_dtype, tma=tma)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


_SMS: dict = {}


def _splits(tiles: int, kb: int, device: torch.device, programs_per_sm: int = 2) -> int:
    """K splits so that tiles x splits reach about programs_per_sm x the SMs (at least 2 K blocks per split)."""
    want = -(-programs_per_sm * _num_sms(device) // tiles)
    return max(1, min(want, kb // 2))


def _tma_supported(device: torch.device) -> bool:
    """Whether a configuration's TMA weight copies can run here: Triton's tensor descriptors on an NVIDIA sm90+ GPU,
    or under the CPU interpreter (which emulates them)."""
    key = (device.type, device.index)
    if key not in _TMA:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
            ok = device.type == "cpu" or (device.type == "cuda" and torch.version.hip is None
                                          and torch.cuda.get_device_capability(device) >= (9, 0))
        except ImportError:
            ok = False
        _TMA[key] = ok
    return _TMA[key]


_TMA: dict = {}


def _tma_fits(w: torch.Tensor, k: int) -> bool:
    return k % 16 == 0 and w.stride(1) == 1 and w.stride(0) == k and w.data_ptr() % 16 == 0


_COUNTERS: dict = {}
# more than the output tiles of any launch _splits splits (fewer than programs_per_sm, at most 8, x the SMs)
_COUNTERS_MIN = 4096


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's int32 split counters, one per output tile of a split-K launch: zeroed once at allocation, put
    back to zero by the launch that counts on them (its last split of each tile), so every later launch and CUDA-graph
    replay finds them zero. Launches on one device must not overlap in time (one stream, as the engine's). A larger
    buffer replaces a smaller one only outside a graph capture; the smaller stays allocated for graphs captured with
    it."""
    key = (device.type, device.index)
    held = _COUNTERS.setdefault(key, [])
    if not held or held[-1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a split-K FP8 GEMM of {tiles} output tiles needs its counters allocated before "
                               "graph capture: run it once eagerly (a warm-up) first")
        held.append(torch.zeros(max(tiles, _COUNTERS_MIN, 2 * held[-1].numel() if held else 0), dtype=torch.int32,
                                device=device))
    return held[-1]


def _launch(a: torch.Tensor, a_scale, w: torch.Tensor, w_scale: torch.Tensor, groups: int,
            out_dtype: torch.dtype, split_k: Optional[int] = None, tma: Optional[bool] = None,
            last_reduces: bool = True, config: Optional[Fp8GemmConfig] = None) -> torch.Tensor:
    """The GEMM launch. config: tile, warps, stages, K-split target and TMA (None: `_config` by rows and shape).
    split_k: K splits (None: by `_splits` at the configuration's programs per SM). tma: forced on (the weight must
    allow it) or off; None: the configuration's where the weight and device allow it. With more than one split and
    last_reduces False, the splits' fp32 partial sums [splits, M, G * N] are returned unsummed (tests and benchmarks
    of the in-kernel reduction: what the two-launch GEMM + sum summed)."""
    a = _rows(a, groups)
    m, k = a.shape[0], a.shape[1] // groups
    n = w.shape[0] // groups
    kb = triton.cdiv(k, BLOCK)
    if m == 0:
        return torch.empty(m, groups * n, dtype=out_dtype, device=a.device)
    quantize_act = a_scale is not None
    if not quantize_act:
        a_scale = w_scale  # not read
    cfg = config or _config(m, a.element_size(), n, k, groups)
    lds = lds_limit(a.device) if config is None else None
    if lds is not None:
        cfg = hip_config(cfg, a.element_size(), lds)
    block_m, block_n = cfg.block_m, cfg.block_n
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m) * groups
    splits = split_k or _splits(tiles, kb, a.device, cfg.programs_per_sm)
    per_split = triton.cdiv(kb, splits)
    splits = triton.cdiv(kb, per_split)  # no empty split
    out = torch.empty(m, groups * n, dtype=out_dtype, device=a.device)
    part, counters = out, out  # not read or written without K splits
    if splits > 1:
        part = torch.empty(splits, m, groups * n, dtype=torch.float32, device=a.device)
        counters = _tile_counters(a.device, tiles) if last_reduces else part
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), groups * splits)
    if tma is None:
        tma = cfg.tma and _tma_fits(w, k) and _tma_supported(a.device)
    w_desc = None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if not _tma_fits(w, k):
            raise ValueError(f"tma needs a contiguous weight with K a multiple of 16, got {tuple(w.shape)} stride "
                             f"{w.stride()}")
        w_desc = TensorDescriptor.from_tensor(w, [block_n, BLOCK])
    _fp8_block_gemm_kernel[grid](a, a_scale, w, w_desc, w_scale, out, part, counters, m, n, k, kb, splits, per_split,
                                 a.stride(0), a_scale.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
                                 part.stride(-2), part.stride(0) if splits > 1 else 0, QUANT_A=quantize_act,
                                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK,
                                 PREC=dot_precision(a.dtype, a.device), TMA=tma, SPLIT_K=splits > 1,
                                 LAST_REDUCES=last_reduces, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if splits == 1 or last_reduces else part
