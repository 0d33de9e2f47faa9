"""Routed experts: each of the three paths dispatch.routed_path picks (torch's grouped GEMM; sgl_kernel's fused Triton
MoE, the GPU's path where torch has no grouped GEMM, here in the Triton interpreter; the CPU's per-expert loop) equals
the per-token definition, repeated picks included, and skips pairs whose id is -1 (another rank's expert under expert
parallelism)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.moe.experts import RoutedExperts, clamped_swiglu


def _per_token(experts: RoutedExperts, x, ids, weights) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            if e < 0:
                continue
            h = clamped_swiglu(experts.w1[e] @ x[t], experts.w3[e] @ x[t], experts.limit)
            out[t] += w * (experts.w2[e] @ h)
    return out


@pytest.mark.parametrize("foreign", [False, True], ids=["all-local", "other-ranks-pairs"])
@pytest.mark.parametrize("path", ["_forward_grouped", "_forward_fused", "_forward_loop"])
def test_expert_paths_equal_the_definition(path, foreign):
    g = torch.Generator().manual_seed(0)
    experts = RoutedExperts(num_experts=6, hidden_size=16, intermediate_size=8, limit=0.5)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(5, 16, generator=g)
        ids = torch.randint(0, 6, (5, 3), generator=g)
        ids[0] = torch.tensor([2, 2, 5])  # the same expert twice for one token: both weights count
        weights = torch.rand(5, 3, generator=g)
        if foreign:  # a NaN weight on another rank's pair would show if it were computed
            ids[1:3, 1] = -1
            ids[4] = -1  # a token with no pair on this rank
            weights = torch.where(ids < 0, float("nan"), weights)
        got = getattr(experts, path)(x, ids, weights)
        torch.testing.assert_close(got, _per_token(experts, x, ids, weights), rtol=1e-5, atol=1e-5)
