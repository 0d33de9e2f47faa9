"""Accepting draft tokens against the target's distributions.

Greedy (temperature 0) acceptance, vectorised over the batch (`accept_greedy`): the longest prefix of drafts equal
to the target's argmax, then one bonus token (the target's argmax after it), so the output is token for token the
non-speculative greedy output. Sampling, here: standard speculative sampling: draft i is kept with probability
min(1, p_i(d)/q_i(d)); on the first rejection a token is drawn from normalise(max(p_i - q_i, 0)) instead; if every
draft is kept, a bonus token is drawn from p_{k+1}. The output distribution then equals sampling from the target
alone. Both run on the device; the cycle's one host transfer happens in EagleWorker.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.sampler import draw, filtered_probs


def accept_sampling(drafts: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor, params,
                    generator: Optional[torch.Generator]) -> tuple:
    """drafts [k], draft_probs [k, V] (the distributions the drafts were drawn from, same filtering as the
    target's), target_logits [k+1, V] -> (tokens [k+1], num_accepted_drafts 0-d), on the device, no host sync.

    tokens[:j] are the accepted drafts and tokens[j] the correction (j < k) or bonus (j = k) token, j =
    num_accepted_drafts; later entries are meaningless. One uniform per draft and one draw per row (the residual
    of each draft position and the bonus row) are made up front; only row j's draw is used, so the output
    distribution is the one of drawing it alone."""
    k = drafts.shape[0]
    device = target_logits.device
    p = filtered_probs(target_logits, params)  # [k+1, V]
    rows = torch.arange(k, device=device)
    u = torch.rand(k, generator=generator, device=device)
    accept = u * draft_probs[rows, drafts] <= p[rows, drafts]  # with probability min(1, p(d) / q(d))
    num_acc = accept.int().cumprod(0).sum()
    residual = (p[:k] - draft_probs).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p[:k])
    draws = draw(torch.cat((residual, p[k:])), generator)  # [k+1]
    positions = torch.arange(k + 1, device=device)
    tokens = torch.where(positions < num_acc, torch.cat((drafts, drafts[:1])), draws.gather(0, num_acc.view(1)))
    return tokens, num_acc


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple:
    """drafts [B, k], target_logits [B, k+1, V] -> (tokens [B, k+1], num_accepted_drafts [B]): the longest prefix
    of drafts equal to the target's argmax, then the target's token after it (correction or bonus); entries after
    that repeat the correction. On the device, no host sync (the eager cycle and the captured one share it)."""
    k = drafts.shape[1]
    best = target_logits.argmax(dim=-1)  # [B, k+1]
    num_acc = (drafts == best[:, :k]).int().cumprod(dim=1).sum(dim=1)
    positions = torch.arange(k + 1, device=drafts.device)[None, :]
    tokens = torch.where(positions < num_acc[:, None], torch.cat((drafts, drafts[:, :1]), dim=1),
                         best.gather(1, num_acc[:, None].long()))
    return tokens, num_acc
