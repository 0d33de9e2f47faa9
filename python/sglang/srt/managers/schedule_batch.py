"""Req (one request's host-side state) and ScheduleBatch (the requests of one forward, turned into a ForwardBatch).

Owner and residence: the Scheduler creates and mutates Req / ScheduleBatch on the host; ScheduleBatch builds
the ForwardBatch (device tensors) for the ModelRunner. A Req's pool slots are held in `alloc` and returned
by the scheduler when the request finishes, aborts or fails. A ReqCheckpoint holds what one step may change in a
Req, so a failed step can be undone and retried (Scheduler.step isolates the request that made it fail).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from sglang.srt.mem_cache.deepseek_v4_allocator import ReqAllocation
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class FinishReason:
    type: str  # "length" | "stop" | "abort"
    length: Optional[int] = None
    matched: Union[int, str, None] = None  # the stop token id or stop string
    message: Optional[str] = None
    status_code: Optional[int] = None  # aborts the server caused or refused: the HTTP status the client gets
    param: Optional[str] = None  # a request refused after it was queued: the field at fault (a grammar's)

    def to_json(self) -> dict:
        out = {"type": self.type}
        for key in ("length", "matched", "message", "status_code", "param"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass
class Req:
    rid: str
    origin_input_ids: list
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is returned; -1: the last one
    output_ids: list = field(default_factory=list)
    alloc: Optional[ReqAllocation] = None
    num_computed: int = 0  # tokens already in the pools (the prefix of fill_ids)
    top_logprobs_num: int = 0  # top logprobs returned with each output token
    input_token_logprobs: list = field(default_factory=list)  # (position, logprob)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)  # per output token: [(logprob, id)] or None
    finished_reason: Optional[FinishReason] = None
    generator: Optional[torch.Generator] = None
    spec: Optional[Any] = None  # SpecState of speculative decoding (the pending draft), set by EagleWorker
    spec_num_verify: int = 0  # speculative verifications of this request
    spec_num_accepted_tokens: int = 0  # tokens they committed (accepted drafts + bonus)
    # speculative: positions [0, draft_len) hold the MTP's window rows of the committed tokens (row p was computed
    # with token p + 1); the prefix cache keeps ends only up to it
    draft_len: int = 0
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    min_tokens_stop_ids: list = field(default_factory=list)  # masked until min_new_tokens (set at admission)
    admitted_time: Optional[float] = None  # first admission (queue time = admitted_time - created_time)
    num_retractions: int = 0  # times the scheduler freed its slots to re-prefill it later
    grammar: Optional[Any] = None  # xgrammar GrammarMatcher of a constrained request (set once its grammar compiled)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (at the first admission)
    cache_node: Optional[Any] = None  # the radix-cache node it reuses (locked while it runs)
    prompt_cached: bool = False  # its prefilled prompt was given to the prefix cache
    split_end: int = 0  # where its prompt leaves the cache's pages with no usable end: a chunk ends there, cached
    prefetch: Optional[Any] = None  # its file tier reads while it waits (mem_cache/file_prefetch.FilePrefetch)
    prefetch_started: bool = False  # its file reads were looked for since it was queued
    # False: it neither starts on a cached prefix nor gives the cache (or its host and file tiers) its pages: a
    # throw-away request (the server's warm-up) leaves the prefix cache as it found it
    use_prefix_cache: bool = True

    @property
    def fill_ids(self) -> list:
        return self.origin_input_ids + self.output_ids

    def token_at(self, position: int) -> int:
        """fill_ids[position] without building the list."""
        n = len(self.origin_input_ids)
        return self.origin_input_ids[position] if position < n else self.output_ids[position - n]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def prefill_len(self) -> int:
        """Positions computed by prefill: the prompt; after a retraction also every generated token but the last (the
        next decode step's input), so the request resumes exactly where it stopped."""
        return len(self.origin_input_ids) + max(0, len(self.output_ids) - 1)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prefill_len

    def emits_token(self, new_rows: int = 0) -> bool:
        """After `new_rows` more computed rows, the last one is the last known token: its sample is the next output
        token (not so for a prompt chunk, nor for the prefill of a retracted request, whose next token is known)."""
        return self.num_computed + new_rows == len(self.origin_input_ids) + len(self.output_ids)

    @property
    def spec_accept_length(self) -> Optional[float]:
        """Tokens committed per verification (speculative decoding), None otherwise."""
        return self.spec_num_accepted_tokens / self.spec_num_verify if self.spec_num_verify else None

    @property
    def logprob_start(self) -> int:
        n = len(self.origin_input_ids)
        return n - 1 if self.logprob_start_len < 0 else min(self.logprob_start_len, n - 1)

    def checkpoint(self, generator_state: Optional[torch.Tensor] = None) -> "ReqCheckpoint":
        """What a step may change here (pool slots past num_computed are the scheduler's to roll back). Taken for
        every request of every step, so it copies only counters (a step starts with no request finished).
        `generator_state`: the seeded generator's state to keep instead of reading it (an earlier checkpoint's)."""
        if generator_state is None and self.generator is not None:
            generator_state = self.generator.get_state()
        return ReqCheckpoint(self.num_computed, len(self.output_ids), len(self.input_token_logprobs),
                             self.first_token_time, self.spec, self.spec_num_verify, self.spec_num_accepted_tokens,
                             self.draft_len, generator_state)

    def restore(self, cp: "ReqCheckpoint") -> None:
        """Undo a step that failed: back to the state `cp` was taken in (the seeded generator included, so a
        retried step draws the same tokens)."""
        self.num_computed = cp.num_computed
        if self.grammar is not None and len(self.output_ids) > cp.num_outputs:
            self.grammar.rollback(len(self.output_ids) - cp.num_outputs)
        for seq in (self.output_ids, self.output_token_logprobs, self.output_top_logprobs):
            del seq[cp.num_outputs:]
        del self.input_token_logprobs[cp.num_input_logprobs:]
        self.finished_reason, self.first_token_time, self.spec = None, cp.first_token_time, cp.spec
        self.spec_num_verify, self.spec_num_accepted_tokens = cp.spec_num_verify, cp.spec_num_accepted_tokens
        self.draft_len = cp.draft_len
        if cp.generator_state is not None:
            self.generator.set_state(cp.generator_state)


@dataclass(slots=True)
class ReqCheckpoint:
    num_computed: int
    num_outputs: int  # output_ids, output_token_logprobs and output_top_logprobs grow together
    num_input_logprobs: int
    first_token_time: Optional[float]
    spec: Optional[Any]  # the SpecState itself: a step replaces it, never mutates it
    spec_num_verify: int
    spec_num_accepted_tokens: int
    draft_len: int
    generator_state: Optional[torch.Tensor]


@dataclass
class ScheduleBatch:
    """Requests of one forward and how many new tokens each contributes."""

    forward_mode: ForwardMode
    reqs: list
    extend_lens: list  # new tokens of each request

    def split(self) -> tuple:
        """The two halves of the batch (same mode), for bisecting a failed step."""
        mid = len(self.reqs) // 2
        return (ScheduleBatch(self.forward_mode, self.reqs[:mid], self.extend_lens[:mid]),
                ScheduleBatch(self.forward_mode, self.reqs[mid:], self.extend_lens[mid:]))

    def to_forward_batch(self, out_cache_loc: torch.Tensor, device) -> ForwardBatch:
        input_ids, targets = [], []
        want_logprobs = any(r.return_logprob for r in self.reqs) and self.forward_mode.is_extend()
        for req, n in zip(self.reqs, self.extend_lens):
            ids = req.fill_ids
            s = req.num_computed
            input_ids.extend(ids[s:s + n])
            if want_logprobs:
                prompt_len = len(req.origin_input_ids)
                for p in range(s, s + n):
                    # row p predicts token p+1; only prompt tokens at or after logprob_start are reported
                    ok = req.return_logprob and req.logprob_start <= p + 1 < prompt_len
                    targets.append(ids[p + 1] if ok else -1)
        return ForwardBatch.build(
            self.forward_mode, input_ids, [r.alloc.req_pool_idx for r in self.reqs],
            [r.num_computed for r in self.reqs], self.extend_lens, out_cache_loc, device,
            logprob_target_ids=targets if want_logprobs else None)
