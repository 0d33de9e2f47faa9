"""DeepSeek-V4 router (`ffn.gate`): sqrtsoftplus scores, bias-corrected or hash-table selection (arch section 6).

Score layers pick top-k of (scores + bias); hash layers (the first `num_hash_layers`) read a fixed
token-id -> experts table `tid2eid`. Both weight the picked experts by their *unbiased* scores, normalised
to sum to one and multiplied by `routed_scaling_factor`. Computed in fp32.

Selection ties go to the lower expert id and the picked ids come out in descending order of (scores + bias): a
stable sort, where torch.topk would leave ties to its implementation, so that the GPU kernel and this torch path
pick the same experts. On GPUs `Gate.route` is one launch (sgl_kernel.dsv4_router): the logits, the selection, the
weights, and the MoE's expert-parallel remapping and fused shared-expert column; the torch code here is the CPU
path and the kernel's reference (sgl_kernel.dsv4_router.dsv4_router_ref follows it op for op). On ROCm with AITER,
score layers above FUSED_MAX_ROWS rows select through AITER's topk_gating (sqrtsoftplus) after the logits GEMM
(layers/aiter_ops.py): the same function, its ties left to its kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt import platform as plat
from sglang.srt.layers import aiter_ops
from sglang.srt.layers.fp32_linear import linear_fp32_out
from sglang.srt.layers.gpu_kernels import sgl_kernel_op


# The one-launch router runs up to this many rows; above, the torch path (a cuBLAS GEMM, sort, gathers) is faster.
# One H100, Flash widths (256 experts, hidden 4,096, fp32 router weight), benchmark/kernels/bench_dsv4_router.py: 6.5 /
# 22.4 / 31.7 / 85.1 us at 1 / 8 / 32 / 128 rows against 43.1 / 55.4 / 53.7 / 62.4 for the torch path (RESULTS:
# Decode: flash-12l256e).
FUSED_MAX_ROWS = 32


def _fused_kernel():
    """sgl_kernel's one-launch router, or None where Triton / sgl_kernel is not installed."""
    return sgl_kernel_op("dsv4_router", "dsv4_router")


def for_local_experts(weights: torch.Tensor, ids: torch.Tensor, local_experts: Optional[range],
                      shared_expert_id: Optional[int]) -> tuple:
    """The router's (weights, global ids) as this rank's experts take them: with `local_experts` (expert
    parallelism) another rank's pairs get id -1 and weight 0 (fixed shapes, no host read: that rank computes them and
    the all-reduce adds them) and this rank's ids become local; with `shared_expert_id` (the fused shared expert)
    every row gets one more column, that expert at weight 1."""
    if local_experts is not None:
        local = ids - local_experts.start
        mine = (local >= 0) & (local < len(local_experts))
        ids, weights = torch.where(mine, local, -1), torch.where(mine, weights, 0.0)
    if shared_expert_id is not None:
        ids = torch.cat((ids, ids.new_full((ids.shape[0], 1), shared_expert_id)), dim=1)
        weights = torch.cat((weights, weights.new_ones(weights.shape[0], 1)), dim=1)
    return weights, ids


class Gate(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, vocab_size: int,
                 routed_scaling_factor: float, use_hash: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.routed_scaling_factor = routed_scaling_factor
        self.use_hash = use_hash
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if use_hash:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple:
        """x [T, D] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64, global expert ids)."""
        return self.route(x, input_ids)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor, local_experts: Optional[range] = None,
              shared_expert_id: Optional[int] = None) -> tuple:
        """forward, then for_local_experts: on GPUs one launch for all of it, up to FUSED_MAX_ROWS rows."""
        fused = _fused_kernel() if plat.is_device_tensor(x) and x.shape[0] <= FUSED_MAX_ROWS else None
        if fused is not None:
            return fused(x, self.weight, None if self.use_hash else self.bias, self.tid2eid if self.use_hash else None,
                         input_ids if self.use_hash else None, self.top_k, self.routed_scaling_factor,
                         local_experts=local_experts, shared_expert_id=shared_expert_id)
        logits = linear_fp32_out(x, self.weight)  # fp32 logits; a bf16 GEMM of bf16 x and a bf16-kept weight
        if not self.use_hash and aiter_ops.use_aiter_router(x, self.weight.shape[0], self.top_k):
            weights, ids = aiter_ops.router_topk(logits, self.bias, self.top_k, self.routed_scaling_factor)
            return for_local_experts(weights, ids, local_experts, shared_expert_id)
        scores = F.softplus(logits).sqrt()
        if self.use_hash:
            ids = self.tid2eid[input_ids]
        else:  # top-k by (value descending, expert ascending): sgl_kernel.dsv4_router.select_top_k
            ids = torch.sort(scores + self.bias.float(), dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling_factor
        return for_local_experts(weights, ids, local_experts, shared_expert_id)
