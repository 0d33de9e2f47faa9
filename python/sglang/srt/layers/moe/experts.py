"""Clamped-SwiGLU experts: the routed experts (stacked weights) and the always-on shared expert.

Expert(x) = w2 . (silu(min(w1 x, L)) * clamp(w3 x, -L, L)), L = swiglu_limit; the clamp is asymmetric and applies
to routed and shared experts alike (arch section 6). Routed weights are stored stacked [E, ...] under the
names `experts.w1|w2|w3`; the loader maps the checkpoint's per-expert tensors into slices.

Shared-experts fusion (`append_shared_expert`, after loading): the shared expert becomes routed expert E, which
every token selects with weight 1, so one grouped pass computes both. Because DeepSeek-V4 clamps shared and
routed experts with the same swiglu_limit, the fused result equals the unfused one (upstream keeps fusion off by
default on CUDA because some fused implementations clamp the shared expert differently).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class RoutedExperts(nn.Module):
    """E experts; forward sums each token's k selected experts weighted by the router.

    The reference path loops over the experts that received tokens; fused MoE kernels replace it later.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.limit = limit

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], topk_ids/topk_weights [T, k] -> [T, D]."""
        out = torch.zeros_like(x)
        flat_ids = topk_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.w1.shape[0]).tolist()
        rows = order // topk_ids.shape[1]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            sel = order[start:start + count]
            tok = rows[start:start + count]
            start += count
            xe = x[tok]
            h = clamped_swiglu(F.linear(xe, self.w1[expert]), F.linear(xe, self.w3[expert]), self.limit)
            y = F.linear(h, self.w2[expert]) * topk_weights.flatten()[sel, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out


def append_shared_expert(routed: RoutedExperts, shared: SharedExpert) -> int:
    """Append the shared expert's weights to the routed stacks as expert E; returns E (its id)."""
    if routed.limit != shared.limit:  # the fused pass applies the routed clamp to it
        raise ValueError(f"shared-experts fusion needs one swiglu_limit, got routed {routed.limit} and shared "
                         f"{shared.limit}")
    shared_id = routed.w1.shape[0]
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            stacked, extra = getattr(routed, name), getattr(shared, name).weight
            fused = torch.cat((stacked.data, extra.data.to(stacked.dtype).unsqueeze(0)), dim=0)
            setattr(routed, name, nn.Parameter(fused, requires_grad=stacked.requires_grad))
    return shared_id
