"""dsv4_compressor_proj: every projection of a compressed layer's rows x that feeds its compressors and indexer, in one
launch (docs/dsv4-architecture.md 5.4, 5.5).

    kv_gate_i[t, 0, c] = sum_k x[t, k] * W_i[c, k]                                 content, c < width_i
    kv_gate_i[t, 1, c] = sum_k x[t, k] * W_i[width_i + c, k] + ape_i[offset[t], c]  gate logit + the slot's bias
    index_w[t, h]      = round_w(sum_k x[t, k] * Wi[h, k]) * scale                   the indexer's head weights

W_i are the compressors' joined wkv | wgate weights [2*width_i, D] in fp32, or bf16 where the engine keeps them so
(one compressor on HCA layers, the attention's and the indexer's on CSA layers), offset[t] = positions[t] % ratio,
ape_i [ratio, width_i] fp32. x and W_i are read as stored (x in bf16 / fp16 / fp32) and widened in registers: the
widening is exact, so no fp32 copy of either is made, and bf16 weights halve the bytes read. Wi is the indexer's
weights_proj [nI, D] in x's dtype: its product is rounded to that dtype (round_w), as the torch linear's output is,
before the fp32 scale (nI^-1/2 dI^-1/2).

Every product and sum is fp32 (the reference computes the compressors in fp32). The sums run in another order than
cuBLAS (K in BLOCK_K chunks), so the values agree with the torch path to fp32 rounding; each output is one
program's sequential sum (no split-K, no atomics): deterministic.

Grid: (output blocks of BLOCK_N rows over the concatenation [W_0; W_1; Wi], row tiles of BLOCK_T <= 4), broadcast
products reduced in registers. The engine runs it at 1-2 rows only (models/deepseek_v4.FUSED_PROJ_MAX_ROWS): one
H100, 2026-12-06, `python3 benchmark/kernels/bench_dsv4_compressor_front.py`: 18.8 / 30.5 us at 1 / 2 rows against
37.4 / 55.1 for the torch path, 74.8 against 59.8 at 4 rows; an fp32 tl.dot tile from 5 rows lost 2-5x to cuBLAS
and was removed.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_compress import _DTYPE_ID, _round_to

@triton.jit
def _dot_rows(x_ptr, stride_x, w_ptr, T, K, t0, n0, N, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """[BLOCK_T, BLOCK_N] fp32: rows t0.. of x times rows n0.. of w (row-major [N, K]); 0 outside."""
    t = t0 + tl.arange(0, BLOCK_T)
    n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x + k[None, :],
                     mask=(t < T)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :],
                     mask=(n < N)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * wv[None, :, :], axis=2)
    return acc


@triton.jit
def _store_kv_gate(acc, out_ptr, ape_ptr, off_ptr, T, t0, n0, W, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows t0.. and columns n0.. of [T, 2*W]: the gate half (columns >= W) plus ape[offset[t]]."""
    t = t0 + tl.arange(0, BLOCK_T)
    n = n0 + tl.arange(0, BLOCK_N)
    mask = (t < T)[:, None] & (n < 2 * W)[None, :]
    gate = (n >= W)[None, :]
    slot = tl.load(off_ptr + t, mask=t < T, other=0).to(tl.int64)
    bias = tl.load(ape_ptr + slot[:, None] * W + (n - W)[None, :], mask=mask & gate, other=0.0)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * (2 * W) + n[None, :], tl.where(gate, acc + bias, acc), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _dsv4_compressor_proj_kernel(x_ptr, stride_x, off_ptr, T, K,
                                 w0_ptr, ape0_ptr, out0_ptr, W0, w1_ptr, ape1_ptr, out1_ptr, W1,
                                 wi_ptr, outi_ptr, NI, scale,
                                 HAS_INDEX: tl.constexpr, ROUND: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_t = tl.program_id(0), tl.program_id(1)
    t0 = pid_t * BLOCK_T
    nb0 = tl.cdiv(2 * W0, BLOCK_N)
    nb1 = tl.cdiv(2 * W1, BLOCK_N)  # W1 = 0: one compressor
    if pid_n < nb0:
        n0 = pid_n * BLOCK_N
        acc = _dot_rows(x_ptr, stride_x, w0_ptr, T, K, t0, n0, 2 * W0, BLOCK_T, BLOCK_N, BLOCK_K)
        _store_kv_gate(acc, out0_ptr, ape0_ptr, off_ptr, T, t0, n0, W0, BLOCK_T, BLOCK_N)
    elif pid_n < nb0 + nb1:
        n0 = (pid_n - nb0) * BLOCK_N
        acc = _dot_rows(x_ptr, stride_x, w1_ptr, T, K, t0, n0, 2 * W1, BLOCK_T, BLOCK_N, BLOCK_K)
        _store_kv_gate(acc, out1_ptr, ape1_ptr, off_ptr, T, t0, n0, W1, BLOCK_T, BLOCK_N)
    elif HAS_INDEX:
        n0 = (pid_n - nb0 - nb1) * BLOCK_N
        acc = _dot_rows(x_ptr, stride_x, wi_ptr, T, K, t0, n0, NI, BLOCK_T, BLOCK_N, BLOCK_K)
        acc = _round_to(acc, ROUND) * scale
        t = t0 + tl.arange(0, BLOCK_T)
        n = n0 + tl.arange(0, BLOCK_N)
        tl.store(outi_ptr + t.to(tl.int64)[:, None] * NI + n[None, :], acc, mask=(t < T)[:, None] & (n < NI)[None, :])


# The compressors' weights: fp32, or bf16 where the engine keeps them bf16 (every value a bf16 value: half the bytes
# read, the same fp32 products once widened in registers).
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def launch_config(num_rows: int) -> dict:
    """Static settings, a function of the row count only (a captured batch size replays what eager runs).
    Decode rows: BLOCK_N output rows per program, BLOCK_T * BLOCK_K = 512 products per output row per step."""
    block_t = min(4, triton.next_power_of_2(max(num_rows, 1)))
    return dict(BLOCK_T=block_t, BLOCK_N=8, BLOCK_K=512 // block_t, num_warps=4)


def check_compressor_proj_args(x, offset, kv_gate_weights, apes, index_weight) -> None:
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in _DTYPE_ID, "x: [T, D] fp32/bf16/fp16, rows contiguous"
    assert offset.shape == (x.shape[0],) and not offset.dtype.is_floating_point, "offset: [T] integer"
    assert 1 <= len(kv_gate_weights) <= 2 and len(apes) == len(kv_gate_weights), "one or two compressors"
    for w, ape in zip(kv_gate_weights, apes):
        assert w.dtype in _WEIGHT_DTYPES and w.is_contiguous() and w.shape[1] == x.shape[1] and w.shape[0] % 2 == 0, \
            f"compressor weight: fp32 / bf16 [2*width, {x.shape[1]}] contiguous, got {w.dtype} {tuple(w.shape)}"
        assert ape.dtype == torch.float32 and ape.is_contiguous() and ape.shape[1] == w.shape[0] // 2, \
            f"ape: fp32 [ratio, {w.shape[0] // 2}], got {ape.dtype} {tuple(ape.shape)}"
    if index_weight is not None:
        assert index_weight.dtype == x.dtype and index_weight.is_contiguous() and index_weight.shape[1] == x.shape[1], \
            "index weight: [nI, D] contiguous in x's dtype"


def dsv4_compressor_proj_ref(x: torch.Tensor, offset: torch.Tensor, kv_gate_weights: Sequence[torch.Tensor],
                             apes: Sequence[torch.Tensor], index_weight: Optional[torch.Tensor] = None,
                             index_scale: float = 1.0) -> tuple:
    """The torch path (models/deepseek_v4.py Compressor / Indexer): ([kv_gate_i [T, 2, width_i] fp32], index
    weights [T, nI] fp32 or None)."""
    check_compressor_proj_args(x, offset, kv_gate_weights, apes, index_weight)
    xf = x.float()
    outs = []
    for w, ape in zip(kv_gate_weights, apes):
        kv_gate = torch.nn.functional.linear(xf, w.float()).view(x.shape[0], 2, -1)
        kv_gate[:, 1].add_(ape[offset])
        outs.append(kv_gate)
    index_w = None
    if index_weight is not None:
        index_w = torch.nn.functional.linear(x, index_weight).float() * index_scale
    return outs, index_w


def dsv4_compressor_proj(x: torch.Tensor, offset: torch.Tensor, kv_gate_weights: Sequence[torch.Tensor],
                         apes: Sequence[torch.Tensor], index_weight: Optional[torch.Tensor] = None,
                         index_scale: float = 1.0, config: Optional[dict] = None) -> tuple:
    """The formula in the module docstring, in one launch: ([kv_gate_i [T, 2, width_i] fp32], index weights
    [T, nI] fp32 or None). config overrides launch_config (benchmark sweeps)."""
    check_compressor_proj_args(x, offset, kv_gate_weights, apes, index_weight)
    T, K = x.shape
    widths = [w.shape[0] // 2 for w in kv_gate_weights]
    outs = [torch.empty(T, 2, width, dtype=torch.float32, device=x.device) for width in widths]
    index_w = None
    ni = 0 if index_weight is None else index_weight.shape[0]
    if index_weight is not None:
        index_w = torch.empty(T, ni, dtype=torch.float32, device=x.device)
    if T == 0:
        return outs, index_w
    cfg = config or launch_config(T)
    bn = cfg["BLOCK_N"]
    blocks = sum(triton.cdiv(2 * width, bn) for width in widths) + triton.cdiv(ni, bn)
    second = len(kv_gate_weights) == 2
    w1, ape1, out1 = (kv_gate_weights[1], apes[1], outs[1]) if second else (kv_gate_weights[0], apes[0], outs[0])
    _dsv4_compressor_proj_kernel[(blocks, triton.cdiv(T, cfg["BLOCK_T"]))](
        x, x.stride(0), offset, T, K, kv_gate_weights[0], apes[0], outs[0], widths[0], w1, ape1, out1,
        widths[1] if second else 0, index_weight if index_weight is not None else x,
        index_w if index_w is not None else outs[0], ni, float(index_scale),
        HAS_INDEX=index_weight is not None, ROUND=_DTYPE_ID[x.dtype], **cfg)
    return outs, index_w


__all__ = ["dsv4_compressor_proj", "dsv4_compressor_proj_ref", "launch_config"]
