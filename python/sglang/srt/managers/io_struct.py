"""Messages between the HTTP process (TokenizerManager) and the scheduler process, grouped by direction.

Tokenizer -> scheduler: TokenizedGenerateReqInput, AbortReq and the control requests (FlushCacheReq, ProfileReq,
UpdateWeightsReq, UpdateTensorsReq, GetWeightsReq, ExpertDistributionReq).
Scheduler -> tokenizer: SchedulerReady (once, over the start-up pipe), BatchOutput (after every step, and to answer
a request that was rejected or aborted, or a control request: its ControlOutput). All are plain dataclasses sent
with pickle over ZMQ. Scheduler -> tokenizer messages carry an HMAC-SHA256 tag (MessageCodec): under DP attention
over several nodes that socket also listens on TCP, and unpickling what anyone on the network sends would run their
code. Tokenizer -> scheduler messages go over an ipc:// socket in a private directory of node 0 only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import pickle
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# ---- tokenizer -> scheduler ---------------------------------------------------------------------------------
@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # prefill/decode disaggregation (--disaggregation-mode prefill|decode): the router's pairing of this request
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None  # None: the default bootstrap port (8998)
    bootstrap_room: Optional[int] = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    """Empty the prefix cache; answered by a ControlOutput with the same rid (400 while requests run)."""

    rid: str


@dataclass
class ClearHiCacheReq:
    """Delete the hierarchical cache's storage tier (the file tier's files); answered by a ControlOutput with the
    same rid (400 without one). The device and host tiers keep what they hold."""

    rid: str


@dataclass
class ProfileReq:
    """Start (with `config`, a scheduler_profiler.ProfileConfig) or stop the torch profiler on every rank; answered
    by a ControlOutput with the same rid."""

    rid: str
    start: bool
    config: Optional[object] = None


@dataclass
class UpdateWeightsReq:
    """Load the checkpoint at `model_path` (the served architecture) into the weights on every rank and empty the
    prefix cache; answered by a ControlOutput with the same rid."""

    rid: str
    model_path: str


@dataclass
class UpdateTensorsReq:
    """Copy (checkpoint name, CPU tensor) pairs into the weights on every rank (each takes its part) and empty the
    prefix cache; answered by a ControlOutput with the same rid."""

    rid: str
    named_tensors: list


@dataclass
class ExpertDistributionReq:
    """Start, stop or dump the expert distribution record on every rank (eplb/expert_distribution.py); answered by a
    ControlOutput with the same rid."""

    rid: str
    action: str  # start | stop | dump


# The most values one GetWeightsReq answer may hold (1,000 rows of 8,192): the rows are pickled to the HTTP process
# and become JSON there, and 1,000 rows of a wide or stacked tensor could otherwise be gigabytes.
MAX_WEIGHT_VALUES = 1000 * 8192


@dataclass
class GetWeightsReq:
    """The first `truncate_size` rows of the weight loaded from checkpoint tensor `name`; answered by a ControlOutput
    whose `data` holds them (the first rank's)."""

    rid: str
    name: str
    truncate_size: int = 100


# ---- scheduler -> tokenizer ---------------------------------------------------------------------------------
@dataclass
class ReqOutput:
    """One request's progress since the last message about it."""

    rid: str
    new_token_ids: list
    new_logprobs: list
    new_top_logprobs: list  # per new token: [(logprob, id)] or None
    prompt_tokens: int
    completion_tokens: int
    finished_reason: Optional[dict] = None  # FinishReason.to_json() once finished
    input_token_logprobs: Optional[list] = None  # [(position, logprob)], sent with the first token
    error: Optional[str] = None  # set when admission refused it (finished_reason.status_code: 400, or 500 on a bug)
    spec_accept_length: Optional[float] = None  # tokens per verification so far (speculative decoding)
    queue_time: Optional[float] = None  # seconds from arrival to first admission, sent once finished
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache


@dataclass
class ControlOutput:
    """The answer to a control request (FlushCacheReq, ProfileReq, UpdateWeightsReq, UpdateTensorsReq,
    GetWeightsReq, ExpertDistributionReq)."""

    rid: str
    status_code: int  # 200; 400 when refused (requests running, a profile already running, ...); 500 when it failed
    message: str
    data: Optional[object] = None  # what a GetWeightsReq asked for (a float32 CPU tensor of its rows)


# /health answers 503 once this many scheduler steps in a row failed for every request in them (a load balancer then
# stops routing here); the next step that serves a request makes it 200 again.
UNHEALTHY_AFTER_FAILED_STEPS = 3


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    token_usage: float  # fraction of KV pages in use
    num_generated_tokens: int  # since start
    pools_all_free: bool = False  # no page, window slot or request slot is held (idle and leak-free)
    spec_accept_length: Optional[float] = None  # mean tokens per verification since start (speculative decoding)
    consecutive_failed_steps: int = 0  # the latest steps in which no request could be served
    num_retractions: int = 0  # requests retracted since start (the pools ran out mid-decode)
    new_token_ratio: float = 0.0  # share of remaining max_new_tokens admission reserves for running requests
    cache_hit_rate: float = 0.0  # prompt tokens served from the prefix cache / prompt tokens looked up, since start
    dp_rank: int = 0  # the DP group these stats are of (DP attention: each group's first rank sends its own)
    transfer: Optional[object] = None  # disaggregation.transfer.TransferStats (prefill / decode servers), taken
    hicache: Optional[object] = None  # mem_cache.host_tier.HostTierStats (--enable-hierarchical-cache), taken
    cache_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache since start
    transfer_queues: Optional[object] = None  # disaggregation.transfer.TransferQueues (prefill / decode servers)

    @property
    def healthy(self) -> bool:
        return self.consecutive_failed_steps < UNHEALTHY_AFTER_FAILED_STEPS

    @staticmethod
    def merge(groups: list) -> "SchedulerStats":
        """The server's stats from each DP group's latest: counts summed, ratios averaged, health the worst."""
        if len(groups) == 1:
            return groups[0]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        accept = [g.spec_accept_length for g in groups if g.spec_accept_length is not None]
        return SchedulerStats(
            num_running_reqs=sum(g.num_running_reqs for g in groups),
            num_waiting_reqs=sum(g.num_waiting_reqs for g in groups),
            token_usage=mean([g.token_usage for g in groups]),
            num_generated_tokens=sum(g.num_generated_tokens for g in groups),
            pools_all_free=all(g.pools_all_free for g in groups),
            spec_accept_length=mean(accept) if accept else None,
            consecutive_failed_steps=max(g.consecutive_failed_steps for g in groups),
            num_retractions=sum(g.num_retractions for g in groups),
            new_token_ratio=mean([g.new_token_ratio for g in groups]),
            cache_hit_rate=mean([g.cache_hit_rate for g in groups]))


@dataclass
class BatchOutput:
    outputs: list
    stats: SchedulerStats


@dataclass
class SchedulerReady:
    """Sent once the model is loaded and the pools are sized."""

    model_path: str
    context_length: int
    vocab_size: int
    max_total_tokens: int
    max_running_requests: int
    eos_token_ids: list
    pool_report: str
    effective_args: dict = field(default_factory=dict)
    stats: Optional[SchedulerStats] = None  # at start (so /server_info has them before the first step)
    warmup_forwards: int = 0  # prefill forwards the warm-up ran before this was sent (managers/server_warmup.py)


# ---- the wire -----------------------------------------------------------------------------------------------
TAG_SIZE = 32  # HMAC-SHA256


def new_channel_key() -> bytes:
    """A fresh random key for one launch's scheduler -> tokenizer channel."""
    return secrets.token_bytes(32)


@dataclass
class MessageCodec:
    """Messages as two ZMQ frames, [HMAC-SHA256 tag, pickle]. `decode` checks the tag before anything is unpickled:
    a peer without `key` cannot make the receiver run code, as any pickle could. A message that is not two frames,
    whose tag does not match, or that is not `expected` is dropped and logged (the first, then at most one line per
    `log_every_s` with the count since), never raised: an open port must not crash or flood its receiver."""

    key: bytes
    log_every_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    dropped: int = 0  # since start
    _unlogged: int = 0
    _last_log: Optional[float] = None

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError("the channel key must be at least 16 bytes")

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self.key, payload, hashlib.sha256).digest()

    def encode(self, obj) -> list:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return [self._tag(payload), payload]

    def decode(self, frames: list, expected: type = object, source: str = "the scheduler channel"):
        """The message `frames` carry, or None when it was dropped."""
        if len(frames) != 2 or len(frames[0]) != TAG_SIZE:
            return self._drop(source, f"not a [tag, payload] message ({len(frames)} frame(s))")
        if not hmac.compare_digest(bytes(frames[0]), self._tag(bytes(frames[1]))):
            return self._drop(source, "its tag does not match this launch's key (not one of its ranks)")
        try:
            obj = pickle.loads(frames[1])
        except Exception as e:  # signed by one of our ranks but unreadable here: another sglang version on that node
            return self._drop(source, f"a signed message that does not unpickle here ({type(e).__name__}: {e}; "
                                      f"is every node on the same sglang version?)")
        if not isinstance(obj, expected):
            return self._drop(source, f"a {type(obj).__name__}, not a {expected.__name__}")
        return obj

    def _drop(self, source: str, reason: str) -> None:
        self.dropped += 1
        self._unlogged += 1
        now = self.clock()
        if self._last_log is None or now - self._last_log >= self.log_every_s:
            logger.warning("dropped %d message(s) on %s; the latest: %s", self._unlogged, source, reason)
            self._unlogged, self._last_log = 0, now
        return None
