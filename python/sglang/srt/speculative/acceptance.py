"""Accepting draft tokens against the target's distributions.

Greedy (temperature 0) acceptance is vectorised in EagleWorker._verify: the longest prefix of drafts equal to the
target's argmax, then one bonus token (the target's argmax after it), so the output is token for token the
non-speculative greedy output. Sampling, here: standard speculative sampling: draft i is kept with probability min(1, p_i(d)/q_i(d)); on the first
rejection a token is drawn from normalise(max(p_i - q_i, 0)) instead; if every draft is kept, a bonus token is drawn
from p_{k+1}. The output distribution then equals sampling from the target alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.sampler import filtered_probs


@dataclass
class Acceptance:
    tokens: list  # accepted drafts, then the bonus / correction token
    num_accepted_drafts: int


def accept_sampling(drafts: list, draft_probs: torch.Tensor, target_logits: torch.Tensor, params,
                    generator: Optional[torch.Generator]) -> Acceptance:
    """draft_probs [k, V]: the distributions the drafts were drawn from (same filtering as the target's)."""
    device = target_logits.device
    for i, d in enumerate(drafts):
        p = filtered_probs(target_logits[i], params)
        q = draft_probs[i]
        u = torch.rand((), generator=generator, device=device)
        if u * q[d] <= p[d]:  # accept with probability min(1, p(d)/q(d))
            continue
        residual = torch.clamp(p - q, min=0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        token = int(torch.multinomial(residual, 1, generator=generator))
        return Acceptance(tokens=drafts[:i] + [token], num_accepted_drafts=i)
    bonus = int(torch.multinomial(filtered_probs(target_logits[len(drafts)], params), 1, generator=generator))
    return Acceptance(tokens=list(drafts) + [bonus], num_accepted_drafts=len(drafts))
