"""Sampler: greedy, or temperature / top-k / top-p / min-p sampling with optional per-request seeds."""

from __future__ import annotations

from typing import Optional

import torch


def sample(logits: torch.Tensor, params: list, generators: list) -> tuple:
    """logits [B, V] fp32 -> (next ids [B], logprobs of those ids under the raw distribution [B])."""
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = torch.argmax(logits, dim=-1)
    for b, p in enumerate(params):
        if not p.is_greedy:
            ids[b] = _sample_one(logits[b], p, generators[b])
    return ids, logprobs.gather(1, ids[:, None]).squeeze(1)


def _sample_one(logits: torch.Tensor, p, generator: Optional[torch.Generator]) -> torch.Tensor:
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_k > 0:
        kth = torch.topk(probs, min(p.top_k, probs.shape[-1])).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > p.top_p * sorted_probs.sum()
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    return torch.multinomial(probs / probs.sum(), 1, generator=generator)[0]
