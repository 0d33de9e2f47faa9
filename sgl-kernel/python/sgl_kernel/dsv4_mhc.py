"""DeepSeek-V4's manifold-constrained hyper-connections (mHC, docs/dsv4-architecture.md section 4) in few launches.

Streams S [T, n, D]; per sub-layer fn [M, n*D] fp32 (M = 2n + n*n), scale [3], base [M]. The torch references are the
engine's own CPU paths in `sglang.srt.layers.mhc` (hc_mix_weights, hc_pre, hc_post, hc_head).

* `dsv4_hc_mix`: the mixing weights from the per-row mixes z [T, M] (fp32; `fn . f / rms(f)` of the flattened
  streams f) in one launch:

      pre  = sigmoid(z[:, :n] * scale[0] + base[:n]) + eps                          [T, n]
      post = 2 * sigmoid(z[:, n:2n] * scale[1] + base[n:2n])                        [T, n]
      comb = Sinkhorn(z[:, 2n:] * scale[2] + base[2n:])                             [T, n, n]

  Sinkhorn: row softmax (+ eps), a column normalisation x / (column sum + eps), then `iters - 1` rounds of row then
  column normalisation. In torch that is about 6 launches per round; here each program keeps its rows' n x n matrices
  in registers for all rounds. Padding (n not a power of two) is kept at exactly 0 so it never enters a sum.
* `dsv4_hc_pre`: the whole sub-layer entry (u [T, D] = sum_j pre_j S_j, post, comb) in two launches: the mixes'
  partial dot products and sums of squares over D chunks (the 1.5 MB fn on Flash is spread over ~all SMs at decode
  instead of one program per token reading all of it), then per token their fixed-order sum, 1/rms, the weights
  above and u. No atomics: a replay equals a plain launch bit for bit. The second launch runs two programs a token
  side by side, one for pre and u, one for post and the Sinkhorn (20 rounds on 4 x 4, a serial latency that u
  otherwise waited for; each program re-sums the token's few KB of partials).
* `dsv4_hc_pre_norm(_fp8)`: dsv4_hc_pre with the sub-layer's RMSNorm (and its FP8 quantization for a W8A8 linear,
  as dsv4_rms_norm_fp8 writes it) in u's program: the whole row is in registers, so hc_pre + norm is two launches
  instead of three and u is never written.
* `dsv4_hc_head`: the same two launches without post and Sinkhorn (the step's last collapse of the streams).
* `dsv4_hc_post`: new streams S'_k = post_k * o + sum_j comb[j, k] * S_j in one launch, fp32 math, one rounding to
  the streams' dtype.

* `dsv4_hc_post_mixes`: dsv4_hc_post that also writes the NEXT sub-layer's partial mixes from the new streams it
  holds in registers (rounded to their dtype, as the next hc_pre would read them), in the layout hc_pre's second
  launch reads: a `MixPartials` that dsv4_hc_pre / dsv4_hc_pre_norm(_fp8) / dsv4_hc_head take (`partials=`) and then
  skip their first launch. Programs (token block, D chunk) as the mixes' (fn read once per token block, spread over
  ~all SMs at decode); a sub-layer's mHC is then 2 launches instead of 3.

Past a few rows two other forms run (SPLIT_MIN_ROWS, FINISH_BLOCKED_MIN_ROWS): the mixes as bf16 MMAs
(_dsv4_hc_mixes_kernel's SPLIT) and, at prefill sizes, hc_pre's post and Sinkhorn in dsv4_hc_mix's 64-token programs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_fp8_gemm import fp8_act_buffers, quantize_rows
from sgl_kernel.dsv4_fp8_gemm_ref import BLOCK as FP8_BLOCK
from sgl_kernel.dsv4_fp8_gemm_ref import fp8_max
from sgl_kernel.dsv4_pdl import pdl_enter, pdl_launch, pdl_supported

BLOCK_T = 64
TARGET_PROGRAMS = 256  # ~2 per SM on an H100: the mixes' reads of fn and the streams spread over the whole GPU
POST_BLOCK_D = 256  # hc_post: columns of every stream a program
U_BLOCK_D = 2048  # hc_pre's second launch: columns of every stream summed into u per loop step
FINISH_BLOCK_C = 32  # hc_pre's second launch: the D chunks' partials summed per loop step
SPLIT_ROLES = True  # hc_pre's second launch: u (and the norm) and the Sinkhorn in two programs a token, side by side
# The mixes as bf16 MMAs (split_mixes) past this many rows of bf16 streams; None: never. One H100 (RESULTS.md
# "Prefill", 2026-12-07, `bench_dsv4_mhc.py --prefill`): 7.8 / 39.2 / 286 us against the FMA dot's 22.8 / 162 / 1,274
# at 128 / 1,024 / 8,192 rows. The tensor cores' fp32 accumulation is coarser than the FMAs' (mixes within 1.6e-6 of
# sum |x w| against 1.5e-7 at 8,192 rows); u and norm(u), rounded to bf16, keep the same largest error.
SPLIT_MIN_ROWS = 16
# hc_pre's post and Sinkhorn comb in 64-token programs (dsv4_hc_mix's kernel) past this many rows, not a program a
# token beside u's; None: never. Same run: hc_pre 427 against 738 us at 8,192 rows, but 74 against 64 / 31 against
# 15 us at 1,024 / 128 (the mixes' normalisation in torch, ~14 us of small kernels, outweighs it there).
FINISH_BLOCKED_MIN_ROWS = 2048
SPLIT_BLOCK_D = 32  # their tiles' columns (the MMA's K) and warps: 64 columns spill (sm90, 4 or 8 warps)
SPLIT_WARPS = 8


@triton.jit
def _pre_gate(z, s, b, eps):
    return tl.sigmoid(z * s + b) + eps


@triton.jit
def _post_gate(z, s, b):
    return 2.0 * tl.sigmoid(z * s + b)


@triton.jit
def _sinkhorn(logits, valid, iters, eps):
    """logits [BLOCK_T, NP, NP] (rows j = input stream, columns k = output stream), `valid` [NP, NP] the real n x n
    entries: row softmax + eps, a column normalisation, then `iters - 1` rounds of row then column normalisation."""
    logits = tl.where(valid[None, :, :], logits, float("-inf"))
    row_max = tl.max(logits, axis=2)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # padded rows: keep -inf - max finite
    e = tl.exp(logits - row_max[:, :, None])  # padding: exp(-inf) = 0
    row_sum = tl.sum(e, axis=2)
    comb = tl.where(valid[None, :, :], e / tl.where(row_sum > 0, row_sum, 1.0)[:, :, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    return comb


@triton.jit
def _dsv4_hc_mix_kernel(z_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, stride_z, iters, eps,
                        N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    j = tl.arange(0, NP)
    jmask = j < N
    rows = z_ptr + t.to(tl.int64)[:, None] * stride_z  # [BLOCK_T, 1]
    m2 = tmask[:, None] & jmask[None, :]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    z_pre = tl.load(rows + j[None, :], mask=m2, other=0.0)
    pre = _pre_gate(z_pre, s0, tl.load(base_ptr + j, mask=jmask, other=0.0)[None, :], eps)
    tl.store(pre_ptr + t.to(tl.int64)[:, None] * N + j[None, :], pre, mask=m2)
    z_post = tl.load(rows + N + j[None, :], mask=m2, other=0.0)
    post = _post_gate(z_post, s1, tl.load(base_ptr + N + j, mask=jmask, other=0.0)[None, :])
    tl.store(post_ptr + t.to(tl.int64)[:, None] * N + j[None, :], post, mask=m2)

    # comb [BLOCK_T, j (input stream), k (output stream)]
    jk = j[:, None] * N + j[None, :]  # [NP, NP]
    valid = jmask[:, None] & jmask[None, :]
    m3 = tmask[:, None, None] & valid[None, :, :]
    logits = tl.load(rows[:, :, None] + 2 * N + jk[None, :, :], mask=m3, other=0.0) * s2 \
        + tl.load(base_ptr + 2 * N + jk, mask=valid, other=0.0)[None, :, :]
    comb = _sinkhorn(logits, valid, iters, eps)
    tl.store(comb_ptr + t.to(tl.int64)[:, None, None] * (N * N) + jk[None, :, :], comb, mask=m3)


def dsv4_hc_mix(z: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, eps: float) -> tuple:
    """z [T, 2n + n*n] fp32, scale [3], base [2n + n*n] -> (pre [T, n], post [T, n], comb [T, n, n]), all fp32."""
    assert z.dim() == 2 and z.shape[1] == 2 * n + n * n and z.dtype == torch.float32 and z.stride(1) == 1, \
        f"z must be [T, {2 * n + n * n}] float32 with contiguous rows, got {tuple(z.shape)} {z.dtype}"
    assert scale.numel() == 3 and base.numel() == 2 * n + n * n, "scale [3] and base [2n + n*n]"
    assert iters >= 1, f"sinkhorn iterations must be >= 1, got {iters}"
    t = z.shape[0]
    pre = torch.empty(t, n, dtype=torch.float32, device=z.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=z.device)
    if t == 0:
        return pre, post, comb
    _dsv4_hc_mix_kernel[(triton.cdiv(t, BLOCK_T),)](
        z, scale.float().contiguous(), base.float().contiguous(), pre, post, comb, t, z.stride(0), iters, eps,
        N=n, NP=triton.next_power_of_2(n), BLOCK_T=BLOCK_T, num_warps=4)
    return pre, post, comb


@triton.jit
def _dsv4_hc_mixes_kernel(s_ptr, fn_ptr, part_ptr, T, D, M, C, stride_st, stride_sn, stride_fn,
                          N: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                          D_TILES: tl.constexpr, SPLIT: tl.constexpr, MMA: tl.constexpr, PDL: tl.constexpr):
    """Program (token block, D chunk): over its D_TILES * BLOCK_D columns of every stream, the partial dot products
    with fn's M rows and the partial sum of squares, written to part [T, C, W] (column M: the sum of squares).
    SPLIT (bf16 streams): fn's tile as three bf16 parts whose sum is it exactly (8 + 8 + 8 significand bits), each
    dotted with the streams' bf16 tile on tensor cores with fp32 accumulation: every product is exact in fp32, as the
    fp32 FMAs' are, at the bf16 MMA's rate (the FMA dot's layout changes per 32-column tile bound it at prefill).
    MMA off (Triton's interpreter, whose bf16 dot is wrong): the same parts dotted as fp32, the same products."""
    pdl_enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    m = tl.arange(0, W)
    mmask = m < M
    rows = s_ptr + t.to(tl.int64)[:, None] * stride_st  # [BLOCK_T, 1]
    fn_rows = fn_ptr + m[None, :].to(tl.int64) * stride_fn  # [1, W]
    dot = tl.zeros([BLOCK_T, W], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    sq_rows = tl.zeros([BLOCK_T], dtype=tl.float32)  # SPLIT: summed per tile (a [BLOCK_T, BLOCK_D] sum spills)
    for i in range(D_TILES):
        d = (tl.program_id(1) * D_TILES + i) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = d < D
        for k in tl.static_range(N):
            x = tl.load(rows + k * stride_sn + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
            w = tl.load(fn_rows + k * D + d[:, None], mask=dmask[:, None] & mmask[None, :], other=0.0)  # [BLOCK_D, W]
            if SPLIT:
                w_hi = w.to(tl.bfloat16)
                rest = w - w_hi.to(tl.float32)  # exact in fp32, as is the rest after the middle part
                w_mid = rest.to(tl.bfloat16)
                w_lo = (rest - w_mid.to(tl.float32)).to(tl.bfloat16)
                if MMA:
                    xb = x.to(tl.bfloat16)
                    dot = tl.dot(xb, w_hi, dot)
                    dot = tl.dot(xb, w_mid, dot)
                    dot = tl.dot(xb, w_lo, dot)
                    x = x.to(tl.float32)
                else:
                    x = x.to(tl.bfloat16).to(tl.float32)
                    dot = tl.dot(x, w_hi.to(tl.float32), dot, input_precision="ieee")
                    dot = tl.dot(x, w_mid.to(tl.float32), dot, input_precision="ieee")
                    dot = tl.dot(x, w_lo.to(tl.float32), dot, input_precision="ieee")
                sq_rows += tl.sum(x * x, axis=1)
            else:
                x = x.to(tl.float32)
                dot = tl.dot(x, w, dot, input_precision="ieee")  # fp32 products and sums, as torch's fp32 matmul
                sq += x * x
    out = tl.where(m[None, :] == M, (sq_rows if SPLIT else tl.sum(sq, axis=1))[:, None], dot)
    tl.store(part_ptr + (t.to(tl.int64)[:, None] * C + tl.program_id(1)) * W + m[None, :], out, mask=tmask[:, None])


@triton.jit(do_not_specialize=["stride_q8"])
def _dsv4_hc_pre_kernel(part_ptr, s_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr, w_ptr, q_ptr, qs_ptr, D, M,
                        C, stride_st, stride_sn, stride_u, stride_q8, stride_qs, stride_qc, width, norm_eps, iters, eps,
                        rms_eps, N: tl.constexpr, NP: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_D: tl.constexpr, MIX: tl.constexpr, NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                        QUANT: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr, ROLES: tl.constexpr,
                        PDL: tl.constexpr):
    """Programs (token, role): each sums the token's partials over the C chunks in a fixed order (column M of a
    partial row: the sum of squares) and takes 1/rms; role 0 then pre and u = sum_j pre_j S_j in the streams' dtype
    (_weighted_sum; NORM: RMSNorm(u), QUANT: quantized too, as dsv4_rmsnorm's kernel writes it, whose note on the
    codes' stride, not specialized to 16, applies here too), role 1 (MIX with ROLES 2) post and the Sinkhorn comb:
    side by side, a token's u (and norm) does not wait for its 20 Sinkhorn rounds. ROLES 1 with MIX: one program
    does both, the comb first."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    jmask = j < N
    jk = j[:, None] * N + j[None, :]  # [NP, NP]
    valid = jmask[:, None] & jmask[None, :]
    c = tl.arange(0, BLOCK_C)
    acc_sq = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc_pre = tl.zeros([BLOCK_C, NP], dtype=tl.float32)
    acc_post = tl.zeros([BLOCK_C, NP], dtype=tl.float32)
    acc_comb = tl.zeros([BLOCK_C, NP, NP], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cmask = c0 + c < C
        rows = part_ptr + (t * C + c0 + c) * W  # [BLOCK_C]
        acc_sq += tl.load(rows + M, mask=cmask, other=0.0)
        acc_pre += tl.load(rows[:, None] + j[None, :], mask=cmask[:, None] & jmask[None, :], other=0.0)
        if MIX:
            acc_post += tl.load(rows[:, None] + N + j[None, :], mask=cmask[:, None] & jmask[None, :], other=0.0)
            acc_comb += tl.load(rows[:, None, None] + 2 * N + jk[None, :, :],
                                mask=cmask[:, None, None] & valid[None, :, :], other=0.0)
    inv_rms = tl.math.rsqrt(tl.sum(acc_sq, axis=0) / width + norm_eps)
    if ROLES == 2:  # post and the Sinkhorn comb in a program of their own, beside u's
        if tl.program_id(1) == 1:
            _post_comb(acc_post, acc_comb, inv_rms, scale_ptr, base_ptr, post_ptr + t * N, comb_ptr + t * (N * N),
                       iters, eps, N, NP)
    elif MIX:  # one program per token: post and comb first
        _post_comb(acc_post, acc_comb, inv_rms, scale_ptr, base_ptr, post_ptr + t * N, comb_ptr + t * (N * N), iters,
                   eps, N, NP)
    if tl.program_id(1) == 0:
        pre = _pre_gate(tl.sum(acc_pre, axis=0) * inv_rms, tl.load(scale_ptr),
                        tl.load(base_ptr + j, mask=jmask, other=0.0), eps)  # [NP]
        _weighted_sum(pre, s_ptr + t * stride_st + j[:, None] * stride_sn, jmask, u_ptr + t * stride_u, w_ptr,
                      q_ptr + t * (stride_q8 * 8), qs_ptr + t * stride_qs, stride_qc, D, rms_eps, BLOCK_D, NORM,
                      HAS_WEIGHT, QUANT, FP8_MAX, ROUND_IN_FP32)


@triton.jit
def _post_comb(acc_post, acc_comb, inv_rms, scale_ptr, base_ptr, post_row, comb_row, iters, eps, N: tl.constexpr,
               NP: tl.constexpr):
    """One token's post and Sinkhorn comb from its summed partials (acc_post [BLOCK_C, NP], acc_comb [BLOCK_C, NP,
    NP]), stored to post_row / comb_row."""
    j = tl.arange(0, NP)
    jmask = j < N
    jk = j[:, None] * N + j[None, :]
    valid = jmask[:, None] & jmask[None, :]
    post = _post_gate(tl.sum(acc_post, axis=0) * inv_rms, tl.load(scale_ptr + 1),
                      tl.load(base_ptr + N + j, mask=jmask, other=0.0))
    tl.store(post_row + j, post, mask=jmask)
    logits = tl.sum(acc_comb, axis=0) * inv_rms * tl.load(scale_ptr + 2) \
        + tl.load(base_ptr + 2 * N + jk, mask=valid, other=0.0)
    comb = _sinkhorn(logits[None, :, :], valid, iters, eps)
    tl.store(comb_row + jk[None, :, :], comb, mask=valid[None, :, :])


@triton.jit
def _weighted_sum(pre, streams, jmask, u_row, w_ptr, q_row, qs_row, stride_qc, D, rms_eps, BLOCK_D: tl.constexpr,
                  NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                  ROUND_IN_FP32: tl.constexpr):
    """u = sum_j pre_j S_j of one token (streams [NP, 1] its rows' pointers) to u_row in its dtype; with NORM (BLOCK_D
    >= D) RMSNorm(u) [* w] instead, u rounded to that dtype first as the norm would read it, and with QUANT also its
    codes (q_row) and per-128-channel multipliers (qs_row, stride_qc apart)."""
    if NORM:
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        x = tl.load(streams + d[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        u = tl.sum(pre[:, None] * x, axis=0).to(u_row.dtype.element_ty).to(tl.float32)
        y = u * tl.math.rsqrt(tl.sum(u * u, axis=0) / D + rms_eps)
        if HAS_WEIGHT:
            y = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32) * y
        y = y.to(u_row.dtype.element_ty)
        tl.store(u_row + d, y, mask=dmask)
        if QUANT:
            q, qscale = quantize_rows(tl.reshape(y.to(tl.float32), [BLOCK_D // 128, 128]), FP8_MAX, ROUND_IN_FP32)
            tl.store(q_row + d, tl.reshape(q, [BLOCK_D]).to(q_row.dtype.element_ty), mask=dmask)
            blocks = tl.arange(0, BLOCK_D // 128)
            tl.store(qs_row + blocks * stride_qc, qscale, mask=blocks * 128 < D)
    else:
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            dmask = d < D
            x = tl.load(streams + d[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            u = tl.sum(pre[:, None] * x, axis=0)
            tl.store(u_row + d, u.to(u_row.dtype.element_ty), mask=dmask)


@triton.jit
def _dsv4_hc_post_kernel(o_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, D, stride_o, stride_st, stride_sn, stride_ot,
                         stride_on, N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program (token, D block): S'_k = post_k * o + sum_j comb[j, k] * S_j for every output stream k, in fp32."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    k = tl.arange(0, NP)
    kmask = k < N
    o = tl.load(o_ptr + t * stride_o + d, mask=dmask, other=0.0).to(tl.float32)
    acc = tl.load(post_ptr + t * N + k, mask=kmask, other=0.0)[:, None] * o[None, :]  # [NP, BLOCK_D]
    for j in tl.static_range(N):
        x = tl.load(s_ptr + t * stride_st + j * stride_sn + d, mask=dmask, other=0.0).to(tl.float32)
        acc += tl.load(comb_ptr + t * (N * N) + j * N + k, mask=kmask, other=0.0)[:, None] * x[None, :]
    tl.store(out_ptr + t * stride_ot + k[:, None] * stride_on + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=kmask[:, None] & dmask[None, :])


@triton.jit
def _dsv4_hc_post_mixes_kernel(o_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, part_ptr, T, D, M, C, stride_o,
                               stride_st, stride_sn, stride_ot, stride_on, stride_fn, N: tl.constexpr,
                               W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, D_TILES: tl.constexpr,
                               PDL: tl.constexpr):
    """Program (token block, D chunk): _dsv4_hc_post_kernel's new streams over its D_TILES * BLOCK_D columns (the
    same fp32 products and sums in the same order, one rounding), then _dsv4_hc_mixes_kernel's partials of those
    rounded streams with the next fn's M rows: part [T, C, W], column M the sum of squares. One output stream at a
    time, each its own BLOCK_D-deep dot (the fp32 dot runs on FMAs, whose operands a thread holds whole: one dot over
    all n streams would not fit in registers); the input streams' tiles are re-read per output stream from L1."""
    pdl_enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    m = tl.arange(0, W)
    mmask = m < M
    fn_rows = fn_ptr + m[None, :].to(tl.int64) * stride_fn  # [1, W]
    dot = tl.zeros([BLOCK_T, W], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for i in range(D_TILES):
        d = (tl.program_id(1) * D_TILES + i) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = d < D
        td = tmask[:, None] & dmask[None, :]
        o = tl.load(o_ptr + t64[:, None] * stride_o + d[None, :], mask=td, other=0.0).to(tl.float32)
        for k in tl.static_range(N):
            acc = tl.load(post_ptr + t64 * N + k, mask=tmask, other=0.0)[:, None] * o
            for j in tl.static_range(N):
                x = tl.load(s_ptr + t64[:, None] * stride_st + j * stride_sn + d[None, :], mask=td, other=0.0)
                acc += tl.load(comb_ptr + t64 * (N * N) + j * N + k, mask=tmask, other=0.0)[:, None] * x.to(tl.float32)
            new = acc.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + t64[:, None] * stride_ot + k * stride_on + d[None, :], new, mask=td)
            x = new.to(tl.float32)  # padding (tokens, columns): 0
            w = tl.load(fn_rows + k * D + d[:, None], mask=dmask[:, None] & mmask[None, :], other=0.0)  # [BLOCK_D, W]
            dot = tl.dot(x, w, dot, input_precision="ieee")
            sq += x * x
    out = tl.where(m[None, :] == M, tl.sum(sq, axis=1)[:, None], dot)
    tl.store(part_ptr + (t64[:, None] * C + tl.program_id(1)) * W + m[None, :], out, mask=tmask[:, None])


@dataclass(frozen=True)
class MixPartials:
    """A sub-layer's partial mixes, written by dsv4_hc_post_mixes for the fn that reads its streams next: part [T, C,
    W] fp32 (per token and D chunk the dot products with fn's `rows` rows, column `rows` the sum of squares)."""
    part: torch.Tensor
    rows: int


@dataclass(frozen=True)
class MixesLaunch:
    """The mixes' grid: token blocks x `chunks` D chunks of `d_tiles` tiles of `block_d` columns (of every stream)."""
    block_t: int
    block_d: int
    d_tiles: int
    chunks: int
    num_warps: int


def mixes_launch(t: int, d: int, max_block_t: int = 64, split: bool = False) -> MixesLaunch:
    """~TARGET_PROGRAMS programs: at decode (one token block) one 32-column tile each, so fn is read by every SM
    once; with more token blocks longer chunks, which also keeps the partials small beside the streams. `split`
    (the bf16 MMAs): SPLIT_BLOCK_D-column tiles, SPLIT_WARPS warps."""
    block_t = 16 if t <= 16 else 32 if t <= 64 or max_block_t <= 32 else 64
    block_d = max(16, min(SPLIT_BLOCK_D if split else 32, triton.next_power_of_2(d)))  # tl.dot needs 16 at least
    tiles = triton.cdiv(d, block_d)
    chunks = max(1, min(tiles, TARGET_PROGRAMS // triton.cdiv(t, block_t)))
    if t > 16:  # two tiles a program at least: a partial row (W fp32) is then <= 1/4 of its bf16 columns
        chunks = max(1, min(chunks, tiles // 2))
    d_tiles = triton.cdiv(tiles, chunks)
    # the fp32 dot runs on FMAs: 8 warps keep 32 / 64-token blocks' operands in registers (sm90: 112 / 182, no spill)
    warps = SPLIT_WARPS if split else 4 if block_t <= 16 else 8
    return MixesLaunch(block_t, block_d, d_tiles, triton.cdiv(tiles, d_tiles), warps)


def split_mixes(streams: torch.Tensor) -> bool:
    """Whether the mixes run as bf16 MMAs (_dsv4_hc_mixes_kernel's SPLIT): bf16 streams past SPLIT_MIN_ROWS, which
    is at least the rows whose mixes hc_post_mixes carries (those stay the FMA dot's, which the carried ones are)."""
    return SPLIT_MIN_ROWS is not None and streams.dtype == torch.bfloat16 and streams.shape[0] > SPLIT_MIN_ROWS


def post_mixes_launch(t: int, d: int) -> MixesLaunch:
    """dsv4_hc_post_mixes's grid: the mixes' with token blocks of at most 32 and 8 warps, so the new streams' tiles
    fit in registers beside the dot's operands (sm90: 133 / 180 a thread at 16 / 32 tokens, no spill; 64-token
    blocks spill even on 16 warps). Past 64 tokens fn is then read by twice as many token blocks (mostly from L2)."""
    return replace(mixes_launch(t, d, max_block_t=32), num_warps=8)


def mixes_width(rows: int) -> int:
    """Columns of a partial row: the `rows` mixes and the sum of squares, a power of two (tl.dot needs 16)."""
    return max(16, triton.next_power_of_2(rows + 1))


def _check_streams(streams: torch.Tensor, fn: torch.Tensor, rows: int) -> None:
    assert streams.dim() == 3 and streams.stride(2) == 1, \
        f"streams must be [T, n, D] with contiguous rows, got {tuple(streams.shape)} strides {streams.stride()}"
    n, d = streams.shape[1], streams.shape[2]
    assert fn.shape == (rows, n * d) and fn.dtype == torch.float32 and fn.stride(1) == 1, \
        f"fn must be [{rows}, {n * d}] float32 with contiguous rows, got {tuple(fn.shape)} {fn.dtype}"


@dataclass(frozen=True)
class FoldedNorm:
    """The RMSNorm folded into hc_pre's second launch: weight [D] or None, eps; `quant`: the result also quantized
    for an FP8 W8A8 linear (cuBLAS's multiplier layout with `cublas_layout`), as dsv4_rms_norm_fp8 writes it."""
    weight: Optional[torch.Tensor]
    eps: float
    quant: bool = False
    cublas_layout: bool = False
    fp8_dtype: torch.dtype = torch.float8_e4m3fn  # the codes' e4m3 encoding: the FP8 linear's weight's


def finish_warps(block_d: int, n: int, norm: bool) -> int:
    """Warps of hc_pre's second launch: 8 with u in column steps; with the norm the whole row of every stream is
    held (8 fp32 a thread up to 16 warps: n 4 x D 4,096 at Flash's widths)."""
    return max(8, min(16, triton.next_power_of_2(n) * block_d // 2048)) if norm else 8


def _collapse(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, mix: bool,
              iters: int, eps: float, norm_eps: float, norm: Optional[FoldedNorm] = None,
              partials: Optional[MixPartials] = None) -> tuple:
    """The two launches of dsv4_hc_pre / dsv4_hc_head / dsv4_hc_pre_norm: (u or with `norm` RMSNorm(u), post, comb,
    codes, multipliers), post and comb left empty without `mix`, the codes and multipliers None without a quant.
    With `partials` (dsv4_hc_post_mixes's of these streams and fn) the second launch only: the mixes are carried."""
    t, n, d = streams.shape
    rows = 2 * n + n * n if mix else n
    dev = streams.device
    u = torch.empty(t, d, dtype=streams.dtype, device=dev)
    post = torch.empty(t, n if mix else 0, dtype=torch.float32, device=dev)
    comb = torch.empty(t, n if mix else 0, n if mix else 0, dtype=torch.float32, device=dev)
    quant = norm is not None and norm.quant
    q, qs = fp8_act_buffers(t, d, d // FP8_BLOCK, norm.cublas_layout, dev, norm.fp8_dtype) if quant else (None, None)
    if t == 0:
        return u, post, comb, q, qs
    width = mixes_width(rows)
    pdl = pdl_supported(dev)
    if partials is None:
        split = split_mixes(streams)
        launch = mixes_launch(t, d, split=split)
        chunks = launch.chunks
        part = torch.empty(t, chunks, width, dtype=torch.float32, device=dev)
        _dsv4_hc_mixes_kernel[(triton.cdiv(t, launch.block_t), chunks)](
            streams, fn, part, t, d, rows, chunks, streams.stride(0), streams.stride(1), fn.stride(0),
            N=n, W=width, BLOCK_T=launch.block_t, BLOCK_D=launch.block_d, D_TILES=launch.d_tiles, SPLIT=split,
            MMA=dev.type == "cuda", PDL=pdl, num_warps=launch.num_warps, **pdl_launch(pdl))
    else:
        part, chunks = partials.part, partials.part.shape[1]
        assert partials.rows == rows and part.shape == (t, chunks, width) and part.is_contiguous(), \
            f"partials must be [{t}, C, {width}] of {rows} rows, got {tuple(part.shape)} of {partials.rows}"
    block_d = triton.next_power_of_2(d) if norm is not None else min(U_BLOCK_D, triton.next_power_of_2(d))
    weight = norm.weight if norm is not None and norm.weight is not None else None
    blocked = mix and FINISH_BLOCKED_MIN_ROWS is not None and t > FINISH_BLOCKED_MIN_ROWS
    roles = 2 if mix and SPLIT_ROLES and not blocked else 1
    scale32, base32 = scale.float().contiguous(), base.float().contiguous()
    if blocked:  # post and the Sinkhorn comb in 64-token programs (the mixes normalised in torch), not one a token
        inv_rms = torch.rsqrt(part[:, :, rows].sum(1, keepdim=True) / (n * d) + norm_eps)
        z = (part[:, :, :rows].sum(1) * inv_rms).contiguous()
        _dsv4_hc_mix_kernel[(triton.cdiv(t, BLOCK_T),)](
            z, scale32, base32, torch.empty_like(post), post, comb, t, z.stride(0), iters, eps, N=n,
            NP=triton.next_power_of_2(n), BLOCK_T=BLOCK_T, num_warps=4)
    _dsv4_hc_pre_kernel[(t, roles)](  # blocked: MIX off, the program a token does pre and u only
        part, streams, scale32, base32, u, post, comb,
        weight if weight is not None else u, q if quant else u, qs if quant else u, d, rows, chunks,
        streams.stride(0), streams.stride(1), u.stride(0), q.stride(0) // 8 if quant else 0,
        qs.stride(0) if quant else 0, qs.stride(1) if quant else 0, float(n * d), norm_eps, iters, eps,
        norm.eps if norm is not None else 0.0,
        N=n, NP=triton.next_power_of_2(n), W=width, BLOCK_C=min(FINISH_BLOCK_C, triton.next_power_of_2(chunks)),
        BLOCK_D=block_d, MIX=mix and not blocked, NORM=norm is not None, HAS_WEIGHT=weight is not None, QUANT=quant,
        FP8_MAX=fp8_max(q.dtype) if quant else 448.0, ROUND_IN_FP32=dev.type != "cuda", ROLES=roles, PDL=pdl,
        num_warps=finish_warps(block_d, n, norm is not None), **pdl_launch(pdl))
    return u, post, comb, q, qs


def dsv4_hc_pre(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
                eps: float, norm_eps: float, partials: Optional[MixPartials] = None) -> tuple:
    """streams [T, n, D], fn [2n + n*n, n*D] fp32, scale [3], base [2n + n*n] -> (u [T, D] in the streams' dtype,
    post [T, n] fp32, comb [T, n, n] fp32): `sglang.srt.layers.mhc.hc_pre` in two launches, one with `partials`
    (dsv4_hc_post_mixes's of these streams for this fn)."""
    _check_pre(streams, fn, scale, base, iters)
    return _collapse(streams, fn, scale, base, True, iters, eps, norm_eps, partials=partials)[:3]


def _check_pre(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int) -> None:
    n = streams.shape[1] if streams.dim() == 3 else 0
    _check_streams(streams, fn, 2 * n + n * n)
    assert scale.numel() == 3 and base.numel() == 2 * n + n * n, "scale [3] and base [2n + n*n]"
    assert iters >= 1, f"sinkhorn iterations must be >= 1, got {iters}"


def dsv4_hc_pre_norm(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
                     eps: float, norm_eps: float, weight: Optional[torch.Tensor], rms_eps: float,
                     partials: Optional[MixPartials] = None) -> tuple:
    """dsv4_hc_pre followed by the sub-layer's RMSNorm of u (weight [D] or None, rms_eps) in the same two launches
    (one with `partials`): (RMSNorm(u) [T, D] in the streams' dtype, post, comb); u itself is not written."""
    _check_pre(streams, fn, scale, base, iters)
    assert weight is None or (weight.shape == (streams.shape[2],) and weight.is_contiguous()), "weight [D] contiguous"
    return _collapse(streams, fn, scale, base, True, iters, eps, norm_eps, FoldedNorm(weight, rms_eps),
                     partials)[:3]


def dsv4_hc_pre_norm_fp8(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                         iters: int, eps: float, norm_eps: float, weight: Optional[torch.Tensor], rms_eps: float,
                         cublas_layout: bool = False, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                         partials: Optional[MixPartials] = None) -> tuple:
    """dsv4_hc_pre_norm whose result is also quantized for the FP8 linear that reads it (D a multiple of 128):
    (RMSNorm(u), post, comb, e4m3 codes in fp8_dtype, multipliers), the codes and multipliers dsv4_rms_norm_fp8's of
    that result."""
    _check_pre(streams, fn, scale, base, iters)
    if streams.shape[2] % FP8_BLOCK:
        raise ValueError(f"the quantized norm needs D a multiple of {FP8_BLOCK}, got {streams.shape[2]}")
    assert weight is None or (weight.shape == (streams.shape[2],) and weight.is_contiguous()), "weight [D] contiguous"
    return _collapse(streams, fn, scale, base, True, iters, eps, norm_eps,
                     FoldedNorm(weight, rms_eps, True, cublas_layout, fp8_dtype), partials)


def dsv4_hc_head(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
                 norm_eps: float, partials: Optional[MixPartials] = None) -> torch.Tensor:
    """streams [T, n, D], fn [n, n*D] fp32, scale [1], base [n] -> [T, D] with w_j = sigmoid(a_j * scale + base_j)
    + eps: `sglang.srt.layers.mhc.hc_head` in two launches."""
    n = streams.shape[1] if streams.dim() == 3 else 0
    _check_streams(streams, fn, n)
    assert scale.numel() == 1 and base.numel() == n, "scale [1] and base [n]"
    return _collapse(streams, fn, scale, base, False, 1, eps, norm_eps, partials=partials)[0]


def dsv4_hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out [T, D], streams [T, n, D], post [T, n] fp32, comb [T, n, n] fp32 -> new streams [T, n, D] in the streams'
    dtype: post (x) out + comb^T . streams with fp32 products and sums, rounded once."""
    _check_post(out, streams, post, comb)
    t, n, d = streams.shape
    new = torch.empty_like(streams, memory_format=torch.contiguous_format)
    if t == 0:
        return new
    pdl = pdl_supported(streams.device)
    _dsv4_hc_post_kernel[(t, triton.cdiv(d, POST_BLOCK_D))](
        out, streams, post, comb, new, d, out.stride(0), streams.stride(0), streams.stride(1), new.stride(0),
        new.stride(1), N=n, NP=triton.next_power_of_2(n), BLOCK_D=POST_BLOCK_D, PDL=pdl, num_warps=4,
        **pdl_launch(pdl))
    return new


def _check_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    assert streams.dim() == 3 and streams.stride(2) == 1, \
        f"streams must be [T, n, D] with contiguous rows, got {tuple(streams.shape)} strides {streams.stride()}"
    t, n, d = streams.shape
    assert out.shape == (t, d) and out.stride(1) == 1, f"out must be [{t}, {d}] with contiguous rows"
    assert post.shape == (t, n) and post.dtype == torch.float32 and post.is_contiguous(), "post [T, n] float32"
    assert comb.shape == (t, n, n) and comb.dtype == torch.float32 and comb.is_contiguous(), "comb [T, n, n] float32"


def dsv4_hc_post_mixes(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                       fn: torch.Tensor) -> tuple:
    """dsv4_hc_post (the same new streams, bit for bit) in one launch that also writes the partial mixes of the new
    streams with the next sub-layer's fn [M, n*D] fp32 (a sub-layer's, M = 2n + n*n, or the head's, M = n): (new
    streams [T, n, D], MixPartials for dsv4_hc_pre / dsv4_hc_pre_norm(_fp8) / dsv4_hc_head's `partials`)."""
    _check_post(out, streams, post, comb)
    t, n, d = streams.shape
    assert fn.dim() == 2 and fn.shape[1] == n * d and fn.dtype == torch.float32 and fn.stride(1) == 1, \
        f"fn must be [M, {n * d}] float32 with contiguous rows, got {tuple(fn.shape)} {fn.dtype}"
    rows, width = fn.shape[0], mixes_width(fn.shape[0])
    launch = post_mixes_launch(max(t, 1), d)  # no tokens: an empty partials tensor of that grid's chunks
    new = torch.empty_like(streams, memory_format=torch.contiguous_format)
    part = torch.empty(t, launch.chunks, width, dtype=torch.float32, device=streams.device)
    if t == 0:
        return new, MixPartials(part, rows)
    pdl = pdl_supported(streams.device)
    _dsv4_hc_post_mixes_kernel[(triton.cdiv(t, launch.block_t), launch.chunks)](
        out, streams, post, comb, new, fn, part, t, d, rows, launch.chunks, out.stride(0), streams.stride(0),
        streams.stride(1), new.stride(0), new.stride(1), fn.stride(0), N=n, W=width, BLOCK_T=launch.block_t,
        BLOCK_D=launch.block_d, D_TILES=launch.d_tiles, PDL=pdl, num_warps=launch.num_warps, **pdl_launch(pdl))
    return new, MixPartials(part, rows)
