"""dsv4_hc_mix: the mixing weights of DeepSeek-V4's manifold-constrained hyper-connections in one launch
(docs/dsv4-architecture.md section 4).

From the per-row mixes z [T, 2n + n*n] (fp32; `fn . f / rms(f)` of the flattened streams):

    pre  = sigmoid(z[:, :n] * scale[0] + base[:n]) + eps                          [T, n]
    post = 2 * sigmoid(z[:, n:2n] * scale[1] + base[n:2n])                        [T, n]
    comb = Sinkhorn(z[:, 2n:] * scale[2] + base[2n:])                             [T, n, n]

Sinkhorn: row softmax (+ eps), a column normalisation x / (column sum + eps), then `iters - 1` rounds of row then
column normalisation. In torch that is about 6 launches per round (20 rounds per sub-layer, two sub-layers per layer:
some 10,000 launches per decode step on DeepSeek-V4-Flash); here each program keeps BLOCK_T rows' n x n matrices in
registers for all rounds. Padding (n not a power of two) is kept at exactly 0 so it never enters a sum.
The torch reference is the engine's own CPU path, `sglang.srt.layers.mhc.hc_mix_weights`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 64


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
    pre = tl.sigmoid(z_pre * s0 + tl.load(base_ptr + j, mask=jmask, other=0.0)[None, :]) + eps
    tl.store(pre_ptr + t.to(tl.int64)[:, None] * N + j[None, :], pre, mask=m2)
    z_post = tl.load(rows + N + j[None, :], mask=m2, other=0.0)
    post = 2.0 * tl.sigmoid(z_post * s1 + tl.load(base_ptr + N + j, mask=jmask, other=0.0)[None, :])
    tl.store(post_ptr + t.to(tl.int64)[:, None] * N + j[None, :], post, mask=m2)

    # comb [BLOCK_T, j (input stream), k (output stream)]
    jk = j[:, None] * N + j[None, :]  # [NP, NP]
    valid = jmask[:, None] & jmask[None, :]
    m3 = tmask[:, None, None] & valid[None, :, :]
    logits = tl.load(rows[:, :, None] + 2 * N + jk[None, :, :], mask=m3, other=0.0) * s2 \
        + tl.load(base_ptr + 2 * N + jk, mask=valid, other=0.0)[None, :, :]
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
