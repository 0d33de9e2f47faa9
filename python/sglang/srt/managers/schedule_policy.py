"""Admission by estimate and the choice of requests to retract (SGLang's scheme, on the DeepSeek-V4 pools).

A request's worst case (prompt + max_new_tokens) is far more than it usually needs: a chat request without max_tokens
may grow to the context length, yet most stop after a few hundred tokens. Admission therefore reserves only an
estimate of what each running request will still need: `new_token_ratio` x its remaining max_new_tokens (clipped to
SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION). The ratio starts at 0.7 x --schedule-conservativeness, decays every decode
step towards 0.14 of that, and is raised when the pools run out mid-decode and requests are retracted. A request being
admitted counts its whole clipped max_new_tokens in the round that admits it (the next rounds count it at the ratio).

Pages bound admission: one page holds a stretch of positions in every compressed pool and the indexer-key pool, so
those are all counted at once. The window pool needs no estimate: it is sized for a full window (plus draft rows) of
every request slot and one prefill chunk (pool_sizing.plan_pools), and prefill chunks are cut to the window slots free.
A request's cached prefix is positions already present: where the cache holds it locked it comes off the request's
need (Scheduler._admit); unlocked, it is among the available pages already (evictable).

Retraction frees the pages a decode step needs: the requests with the fewest generated tokens go first (the least
work lost), the longest context first among equals (they free the most). A retracted request keeps its generated
tokens and is re-prefilled later; nothing is copied to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang.srt.environ import envs

INIT_NEW_TOKEN_RATIO = 0.7  # x --schedule-conservativeness
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # the floor, as a fraction of the initial ratio
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # decode steps from the initial ratio to the floor
RETRACT_DECODE_STEPS = 20  # after a retraction, each running request is expected to decode this many more tokens


@dataclass
class NewTokenRatio:
    """The fraction of a running request's remaining max_new_tokens that admission expects it to still generate."""

    init: float
    floor: float
    decay: float
    value: float

    @classmethod
    def from_conservativeness(cls, conservativeness: float) -> "NewTokenRatio":
        init = min(1.0, INIT_NEW_TOKEN_RATIO * conservativeness)
        floor = min(1.0, init * MIN_NEW_TOKEN_RATIO_FACTOR)
        return cls(init=init, floor=floor, decay=(init - floor) / NEW_TOKEN_RATIO_DECAY_STEPS, value=init)

    def step(self) -> None:
        """A decode step ran without a retraction: trust the estimate a little more."""
        self.value = max(self.floor, self.value - self.decay)

    def reset(self) -> None:
        """Nothing runs or waits: start again from the initial ratio."""
        self.value = self.init

    def raise_after_retraction(self, running: list, clip: int) -> None:
        """The pools ran out: expect every still-running request to decode RETRACT_DECODE_STEPS more tokens on top of
        what they have, as a share of their (clipped) max_new_tokens; never lower than the ratio already in use."""
        if not running:
            return
        decoded = sum(len(r.output_ids) for r in running)
        budget = sum(min(r.sampling_params.max_new_tokens, clip) for r in running)
        estimate = (decoded + RETRACT_DECODE_STEPS * len(running)) / max(1, budget)
        self.value = min(1.0, max(self.value, estimate))


def clip_max_new_tokens() -> int:
    return envs.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.get()


def expected_tokens(req, ratio: float, clip: int, num_draft_tokens: int) -> int:
    """Positions a running request is expected to hold when it finishes: what it has (prompt + generated), plus
    `ratio` x its remaining max_new_tokens (clipped), plus the draft rows of a speculative cycle."""
    remaining = max(0, req.sampling_params.max_new_tokens - len(req.output_ids))
    return len(req.origin_input_ids) + len(req.output_ids) + math.ceil(ratio * min(remaining, clip)) + num_draft_tokens


def retraction_order(reqs: list) -> list:
    """`reqs` in the order they are retracted: fewest generated tokens first, then the longest context."""
    return sorted(reqs, key=lambda r: (len(r.output_ids), -(len(r.origin_input_ids) + len(r.output_ids))))
