"""TokenizerManager: the HTTP process's side of generation.

It tokenizes, sends requests to the scheduler process over ZMQ, receives each step's progress, detokenizes
incrementally and hands SGLang-shaped chunks (`text`, `output_ids`, `meta_info`, shaped by managers/output_shaping.py
as sglang.Engine's output is) to the endpoints. Prompts are validated in one place, the scheduler's admission
(Scheduler.add_request): a refused one comes back as a RequestError with the status to answer (400). A request
whose client goes away is aborted, which frees its slots in the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional

import zmq
import zmq.asyncio

from sglang.srt.managers.detokenizer import IncrementalDetokenizer
from sglang.srt.managers.io_struct import (
    AbortReq, BatchOutput, ControlOutput, ExpertDistributionReq, FlushCacheReq, GetWeightsReq, ProfileReq, ReqOutput,
    SchedulerReady, SchedulerStats, TokenizedGenerateReqInput, UpdateTensorsReq, UpdateWeightsReq)
from sglang.srt.managers.output_shaping import OutputState
from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestError(Exception):
    """A request refused (by the endpoint or the scheduler's admission) or that could not finish; carries the
    HTTP status to answer with."""

    def __init__(self, message: str, status_code: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param = message, status_code, param


@dataclass
class GenerationChunk:
    text: str  # cumulative visible text
    output_ids: list  # cumulative
    meta_info: dict
    finished: bool

    def to_dict(self) -> dict:
        """SGLang's output dict (what /generate answers and sglang.Engine returns)."""
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info}


@dataclass
class ReqState(OutputState):
    """A request in flight: its output so far, plus what the HTTP side needs to stream it."""

    detok: Optional[IncrementalDetokenizer] = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    queue_time: Optional[float] = None  # from arrival to first admission in the scheduler (set once finished)
    group: Optional[str] = None  # the client's rid of a /generate whose n samples carry rids of their own
    # the scheduler's id of this request (`rid` is the client's): unique even when a client reuses a rid the moment
    # its earlier request was dropped, so the earlier one's late abort answer never reaches the new request
    sid: str = ""
    # whether its HTTP client has gone (Request.is_disconnected): a request reusing the rid asks it first
    client_gone: Optional[Callable[[], Awaitable[bool]]] = None
    aborted: bool = False  # /abort_request sent its abort: the rid is free for a new request at once


class TokenizerManager:
    def __init__(self, tokenizer, ready: SchedulerReady, scheduler_input: str, tokenizer_input: str,
                 metrics=None, tokenizer_input_remote: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.ready = ready
        self.metrics = metrics
        self.ctx = ctx = zmq.asyncio.Context()
        self.send = ctx.socket(zmq.PUSH)
        self.send.setsockopt(zmq.LINGER, 0)  # never block process exit on messages to a dead scheduler
        self.send.connect(scheduler_input)
        self.recv = ctx.socket(zmq.PULL)
        self.recv.setsockopt(zmq.LINGER, 0)
        self.recv.bind(tokenizer_input)
        if tokenizer_input_remote:  # DP groups led from other nodes (DP attention over several nodes)
            self.recv.bind(tokenizer_input_remote)
        self.states: dict = {}  # sid -> ReqState
        self.dead_reason: Optional[str] = None
        self.last_stats = ready.stats  # the scheduler's at start, then each step's
        self.group_stats: dict = {}  # DP group -> its latest SchedulerStats
        self.control: dict = {}  # rid -> future of a control request's ControlOutput (io_struct)
        self.updating: Optional[asyncio.Event] = None  # set when a weight update ends; new requests wait for it
        self.weights_path: Optional[str] = None  # the checkpoint of the last weight update (None: the launch's)
        self._loop_task: Optional[asyncio.Task] = None

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    # ---- tokenization -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list:
        """Token ids of `text`. Endpoints call this in a worker thread (asyncio.to_thread): a long prompt takes
        seconds, and `encode_batch` releases the GIL where `encode` holds it, so the event loop keeps serving."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: send input_ids instead of text")
        try:
            return self.tokenizer.encode_batch([text])[0].ids
        except TypeError:  # the tokenizer's answer to text it cannot take as UTF-8 (a lone surrogate)
            raise RequestError("the text is not valid unicode (it holds a lone UTF-16 surrogate)") from None

    def decode(self, ids: list, skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.ready.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.ready.vocab_size})")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- generation -------------------------------------------------------------------------------------
    async def _free_rid(self, rid: str, group: Optional[str]) -> None:
        """Raise a 400 if a running request holds `rid`, unless each one holding it has lost its client: those are
        dropped now (aborted in the scheduler, their handlers ended with 499) instead of when their handlers notice
        (a non-streaming one polls every 0.5 s), so a client retrying with its rid is not refused meanwhile. A
        /generate with n samples holds its rid as their `group` (/abort_request with it aborts them all): a single
        request with that rid, or samples of that group beside a single request with it, are refused alike."""
        def holds(state: ReqState) -> bool:
            return state.rid == rid or (state.group == rid if group is None else state.rid == group)

        while True:
            holders = [state for state in self.states.values() if holds(state) and not state.aborted]
            if not holders:
                return  # checked with no await before the caller registers its own request
            for state in holders:
                if state.client_gone is None or not await state.client_gone():
                    raise RequestError(f"rid {group or rid!r} is already in use by a running request", param="rid")
            for state in holders:
                if self.states.pop(state.sid, None) is not None:
                    state.finished_reason = {"type": "abort", "status_code": 499, "message": "client disconnected"}
                    state.queue.put_nowait(ReqOutput(rid=state.sid, new_token_ids=[], new_logprobs=[],
                                                     new_top_logprobs=[], prompt_tokens=len(state.input_ids),
                                                     completion_tokens=0, finished_reason=state.finished_reason))
                    await self.send.send_pyobj(AbortReq(state.sid))

    async def generate(self, input_ids: list, params: SamplingParams, return_logprob: bool = False,
                       logprob_start_len: int = -1, top_logprobs_num: int = 0, rid: Optional[str] = None,
                       group: Optional[str] = None,
                       client_gone: Optional[Callable[[], Awaitable[bool]]] = None) -> AsyncIterator[GenerationChunk]:
        """Yield a chunk whenever the request makes progress; the last one has finished=True.
        Raises RequestError when the scheduler refuses the request (Scheduler.add_request validates the prompt
        and the sampling params: empty, context length, vocabulary, ...). Cancelling the iteration aborts it.
        `rid`: the client's request id (a 400 while a running request whose client is still there has it); `group`:
        see `abort_matching`; `client_gone`: whether this request's client has disconnected."""
        while self.updating is not None:  # a weight update: requests that arrive meanwhile start after it
            await self.updating.wait()
        if self.dead_reason is not None:
            raise RequestError(self.dead_reason, 503)
        self.start()
        if rid is not None:
            await self._free_rid(rid, group)
        sid = uuid.uuid4().hex if rid is None else f"{rid}.{uuid.uuid4().hex[:12]}"
        rid = rid or sid
        detok = None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens, params.stop, params.no_stop_trim, params.stop_regex,
            params.min_new_tokens)
        state = ReqState(rid=rid, input_ids=list(input_ids), return_logprob=return_logprob,
                         logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, detok=detok,
                         group=group, sid=sid, client_gone=client_gone)
        self.states[sid] = state
        await self.send.send_pyobj(TokenizedGenerateReqInput(
            rid=sid, input_ids=state.input_ids, sampling_params=params, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num))
        try:
            while True:
                out: ReqOutput = await state.queue.get()
                if out.finished_reason is not None:
                    state.finished_reason = out.finished_reason  # nothing left to abort in the scheduler
                if out.error is not None:
                    raise RequestError(out.error, (out.finished_reason or {}).get("status_code", 400))
                reason = out.finished_reason or {}
                if reason.get("type") == "abort" and reason.get("status_code"):
                    raise RequestError(reason.get("message", "aborted"), reason["status_code"], reason.get("param"))
                chunk = self._apply(state, out)
                yield chunk
                if chunk.finished:
                    return
        finally:
            if state.finished_reason is None:  # the caller stopped listening: free the scheduler's slots
                await self.send.send_pyobj(AbortReq(sid))
            self.states.pop(sid, None)

    def _apply(self, state: ReqState, out: ReqOutput) -> GenerationChunk:
        now = time.perf_counter()
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = now
            if self.metrics:
                self.metrics.observe_ttft(now - state.created)
        state.output_ids.extend(out.new_token_ids)
        state.logprobs.extend(out.new_logprobs)
        state.top_logprobs.extend(out.new_top_logprobs)
        if out.input_token_logprobs is not None:
            state.set_input_logprobs(out.input_token_logprobs)
        if state.detok is not None:
            state.detok.add(out.new_token_ids)
        state.finished_reason = out.finished_reason
        state.spec_accept_length = out.spec_accept_length
        state.cached_tokens = out.cached_tokens
        state.queue_time = out.queue_time if out.queue_time is not None else state.queue_time
        finished = out.finished_reason is not None
        text = state.detok.visible_text(out.finished_reason) if state.detok else ""
        if finished and self.metrics:
            self.metrics.observe_finished(state, now)
        return GenerationChunk(text=text, output_ids=list(state.output_ids), meta_info=state.meta_info(
            now - state.created), finished=finished)

    async def abort_matching(self, rid: Optional[str], abort_all: bool = False) -> list:
        """/abort_request: abort every running request (abort_all), or the one with this rid and the samples of a
        /generate that gave it (their `group`); each finishes with what it has so far (finish_reason abort).
        Returns the rids aborted."""
        targets = [state for state in self.states.values()
                   if not state.aborted and (abort_all or rid in (state.rid, state.group))]
        for state in targets:
            state.aborted = True
            await self.send.send_pyobj(AbortReq(state.sid))
        return [state.rid for state in targets]

    async def flush_cache(self) -> str:
        """Empty the scheduler's prefix cache; its answer once done. RequestError (400) when it refused: requests
        are running there (the HTTP side may not know of all of them yet, or any more)."""
        return (await self._control(FlushCacheReq, timeout=60.0)).message

    async def profile(self, start: bool, config=None, timeout: float = 600.0) -> str:
        """Start (with a scheduler_profiler.ProfileConfig) or stop the scheduler's profiler; returns its message,
        raises RequestError with its status when refused or failed. Stopping writes the traces: it can take a while."""
        return (await self._control(lambda rid: ProfileReq(rid, start, config), timeout)).message

    async def update_weights_from_disk(self, model_path: str, abort_all: bool = False) -> str:
        """Load another checkpoint of the served model (as upstream's /update_weights_from_disk; see `_update`).
        Returns the scheduler's message; RequestError (400) when it refused (nothing changed)."""
        answer = await self._update(lambda rid: UpdateWeightsReq(rid, model_path), abort_all)
        self.weights_path = model_path
        return answer.message

    async def update_weights_from_tensor(self, named_tensors: list, abort_all: bool = False) -> str:
        """Copy (checkpoint name, CPU tensor) pairs into the served weights (ModelRunner.update_weights_from_tensor;
        see `_update`)."""
        return (await self._update(lambda rid: UpdateTensorsReq(rid, named_tensors), abort_all)).message

    async def _update(self, make, abort_all: bool, drain_timeout: float = 600.0) -> ControlOutput:
        """A weight update: new requests wait; running ones finish first (or are aborted: abort_all), then every
        rank applies make(rid) in place and empties its prefix cache."""
        if self.updating is not None:
            raise RequestError("a weight update is already in progress", 409)
        self.updating = asyncio.Event()
        try:
            if abort_all:
                await self.abort_matching(None, abort_all=True)
            deadline = time.perf_counter() + drain_timeout
            while self.states:  # the running requests' last outputs
                if time.perf_counter() > deadline:
                    raise RequestError(f"{len(self.states)} request(s) still running after {drain_timeout:.0f} s; "
                                       f"retry, or send abort_all_requests: true", 503)
                await asyncio.sleep(0.01)
            return await self._control(make, timeout=3600.0)
        finally:
            self.updating.set()
            self.updating = None

    async def expert_distribution(self, action: str) -> str:
        """start / stop / dump the expert distribution record on every rank (eplb/expert_distribution.py)."""
        return (await self._control(lambda rid: ExpertDistributionReq(rid, action), timeout=120.0)).message

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first rows of the weight loaded from checkpoint tensor `name` (upstream's /get_weights_by_name)."""
        return (await self._control(lambda rid: GetWeightsReq(rid, name, truncate_size), timeout=60.0)).data

    async def _control(self, make, timeout: float) -> ControlOutput:
        """Send make(rid) to the scheduler and wait for its ControlOutput (the first, under DP attention); RequestError
        with its status when refused."""
        if self.dead_reason is not None:
            raise RequestError(self.dead_reason, 503)
        self.start()
        rid = uuid.uuid4().hex
        answer = self.control[rid] = asyncio.get_running_loop().create_future()
        try:
            await self.send.send_pyobj(make(rid))
            out: ControlOutput = await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"the scheduler did not answer within {timeout:.0f} s", 503) from None
        finally:
            self.control.pop(rid, None)
        if out.status_code != 200:
            raise RequestError(out.message, out.status_code)
        return out

    # ---- receiving ----------------------------------------------------------------------------------------
    async def _handle_loop(self) -> None:
        while True:
            batch: BatchOutput = await self.recv.recv_pyobj()
            self.group_stats[batch.stats.dp_rank] = batch.stats  # DP attention: one sender per group
            self.last_stats = SchedulerStats.merge(list(self.group_stats.values()))
            if self.metrics:
                self.metrics.observe_stats(self.last_stats)
            for out in batch.outputs:
                if isinstance(out, ControlOutput):  # DP attention: each group answers; the first one counts
                    answer = self.control.get(out.rid)
                    if answer is not None and not answer.done():
                        answer.set_result(out)
                    continue
                state = self.states.get(out.rid)
                if state is not None:
                    state.queue.put_nowait(out)

    def close(self) -> None:
        """Stop receiving and release the ZMQ sockets (call from the event loop's thread)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.send.close(linger=0)
        self.recv.close(linger=0)
        self.ctx.term()

    def fail_all(self, reason: str) -> None:
        """The scheduler process died: answer every waiting request with a 503."""
        self.dead_reason = reason
        for rid, state in list(self.states.items()):
            state.queue.put_nowait(ReqOutput(rid=rid, new_token_ids=[], new_logprobs=[], new_top_logprobs=[],
                                             prompt_tokens=state.prompt_tokens, completion_tokens=0,
                                             finished_reason={"type": "abort", "status_code": 503}, error=reason))
        for rid, answer in list(self.control.items()):
            if not answer.done():
                answer.set_result(ControlOutput(rid, 503, reason))
