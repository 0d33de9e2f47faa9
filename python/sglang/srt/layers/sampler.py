"""Sampler: penalties (and min_new_tokens' stop-token mask), then greedy or temperature / top-k / top-p / min-p
sampling with per-request seeds.

Logprobs (and top logprobs) are those of the model's raw distribution (before penalties and temperature), as
SGLang reports them. Penalties follow OpenAI / common practice: frequency and presence on the tokens generated so
far; repetition (divide positive logits, multiply negative ones) on prompt and generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.utils.device_readback import ReadBack


@dataclass
class SampleOutput:
    ids: list  # [B] chosen token ids
    logprobs: list  # [B] their logprobs
    top_logprobs: list  # [B] list of (logprob, id) pairs, or None for requests that asked for none


def sample(logits: torch.Tensor, reqs: list, grammar=None) -> SampleOutput:
    """logits [B, V] fp32 at each request's last row; reqs carry sampling_params, generator, token history and, when
    constrained, a grammar matcher that `grammar` (the XGrammarBackend) masks the logits with."""
    return sample_async(logits, reqs, grammar).wait()


@dataclass
class PendingSample:
    """A sampling launched on the device whose read-back is under way (overlap scheduling resolves it a step later).
    `ids` [B] stay on the device: the next decode step can take them as its input tokens."""

    ids: torch.Tensor
    readback: ReadBack
    reqs: list
    k: int  # top logprobs read back per row (0: none)

    def wait(self) -> SampleOutput:
        host, num, k = self.readback.wait(), len(self.reqs), self.k
        top = [None] * num
        if k > 0:
            values, indices = host[2 * num:2 * num + num * k], host[2 * num + num * k:]
            for b, req in enumerate(self.reqs):
                if req.top_logprobs_num:
                    row = range(b * k, b * k + req.top_logprobs_num)
                    top[b] = [(values[i], int(indices[i])) for i in row]
        return SampleOutput([int(v) for v in host[:num]], host[num:2 * num], top)


def sample_async(logits: torch.Tensor, reqs: list, grammar=None) -> PendingSample:
    """Launch the sampling of `reqs` and the read-back of its results (one copy, not waited for). Reported logprobs
    are the model's, before penalties and grammar masks."""
    logprobs = torch.log_softmax(logits, dim=-1)
    adjusted = _apply_penalties(logits, reqs)
    if grammar is not None and any(r.grammar is not None for r in reqs):
        adjusted = grammar.apply(adjusted, [r.grammar for r in reqs])
    ids = torch.argmax(adjusted, dim=-1)
    for b, req in enumerate(reqs):
        if not req.sampling_params.is_greedy:
            ids[b] = _sample_one(adjusted[b], req.sampling_params, req.generator)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1)
    k_max = max((r.top_logprobs_num for r in reqs), default=0)
    k = min(k_max, logprobs.shape[-1])
    parts = [ids.to(torch.float64), chosen.to(torch.float64)]  # token ids < 2^53: exact in float64
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        parts += [values.flatten().to(torch.float64), indices.flatten().to(torch.float64)]
    return PendingSample(ids, ReadBack(torch.cat(parts)), list(reqs), k)  # the step's one device read


def _apply_penalties(logits: torch.Tensor, reqs: list) -> torch.Tensor:
    if not any(r.sampling_params.adjusts_logits for r in reqs):
        return logits
    logits = logits.clone()
    for b, req in enumerate(reqs):
        if req.sampling_params.adjusts_logits:
            logits[b] = penalize_rows(logits[b:b + 1], req)[0]
    return logits


def penalize_rows(rows: torch.Tensor, req, drafts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Penalised copy of `rows` [R, V], the next-token logits of one request after its generated tokens and, for row
    i, the first i of `drafts` [R-1] (speculative verification: row i follows drafts d_1..d_i). Plain decode is the
    R = 1 case. Counts are built on the device (scatter_add: no host sync)."""
    p = req.sampling_params
    num_rows, vocab = rows.shape
    device = rows.device
    out = torch.tensor(req.output_ids, dtype=torch.int64).to(device, non_blocking=True)
    counts = torch.zeros(vocab, dtype=rows.dtype, device=device).scatter_add_(
        0, out, torch.ones(out.shape, dtype=rows.dtype, device=device))[None, :]  # [1, V]
    if drafts is not None and num_rows > 1:
        hot = torch.zeros(num_rows, vocab, dtype=rows.dtype, device=device)
        hot[1:].scatter_(1, drafts[:num_rows - 1, None], 1.0)
        counts = counts + hot.cumsum(dim=0)  # row i: + d_1..d_i
    rows = rows - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(rows.dtype))
    if p.min_new_tokens > 0 and len(req.output_ids) < p.min_new_tokens:  # row i has len(output_ids) + i tokens
        short = (torch.arange(num_rows, device=device) + len(req.output_ids) < p.min_new_tokens)[:, None]
        stops = torch.zeros(vocab, dtype=torch.bool, device=device)
        stops = stops.index_fill(0, torch.tensor(req.min_tokens_stop_ids, dtype=torch.int64).to(
            device, non_blocking=True), True)[None, :]
        rows = rows.masked_fill(short & stops, float("-inf"))
    if p.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        history = torch.tensor(req.origin_input_ids + req.output_ids, dtype=torch.int64).to(device, non_blocking=True)
        seen = seen.index_fill(0, history, True)[None, :] | (counts > 0)
        rows = torch.where(seen, torch.where(rows > 0, rows / p.repetition_penalty, rows * p.repetition_penalty),
                           rows)
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.int64).to(device, non_blocking=True)
        bias = torch.tensor(list(p.logit_bias.values()), dtype=rows.dtype).to(device, non_blocking=True)
        rows = rows.index_add(1, ids, bias[None, :].expand(num_rows, -1))
    return rows


def filtered_probs(logits: torch.Tensor, p) -> torch.Tensor:
    """The sampling distribution of each row [..., V]: softmax(logits / temperature) restricted by top-k, top-p,
    min-p and renormalised (speculative acceptance uses the same distribution for draft and target)."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_k > 0:
        kth = torch.topk(probs, min(p.top_k, probs.shape[-1])).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > p.top_p * sorted_probs.sum(-1, keepdim=True)
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.amax(-1, keepdim=True), probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


def draw(weights: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One index per row of `weights` [..., V] (>= 0, not necessarily normalised), with probability proportional to
    the weight: the row's argmax of w / E, E ~ Exponential(1) i.i.d. (the exponential race). Unlike
    torch.multinomial, which reads the device to validate its input, it never synchronises."""
    race = torch.empty_like(weights).exponential_(generator=generator).clamp_min(torch.finfo(weights.dtype).tiny)
    return torch.argmax(weights / race, dim=-1)


def _sample_one(logits: torch.Tensor, p, generator: Optional[torch.Generator]) -> torch.Tensor:
    return draw(filtered_probs(logits, p), generator)
