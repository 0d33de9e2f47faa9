"""DeepSeek-V4 router (`ffn.gate`): sqrtsoftplus scores, bias-corrected or hash-table selection (arch section 6).

Score layers pick top-k of (scores + bias); hash layers (the first `num_hash_layers`) read a fixed
token-id -> experts table `tid2eid`. Both weight the picked experts by their *unbiased* scores, normalised
to sum to one and multiplied by `routed_scaling_factor`. Computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        """x [T, D] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = F.softplus(logits).sqrt()
        if self.use_hash:
            ids = self.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids
