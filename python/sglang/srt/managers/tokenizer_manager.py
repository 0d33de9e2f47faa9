"""TokenizerManager: the HTTP process's side of generation.

It tokenizes, sends requests to the scheduler process over ZMQ, receives each step's progress, detokenizes
incrementally and hands SGLang-shaped chunks (`text`, `output_ids`, `meta_info`, shaped by managers/output_shaping.py
as sglang.Engine's output is) to the endpoints. Prompts are validated in one place, the scheduler's admission
(Scheduler.add_request): a refused one comes back as a RequestError with the status to answer (400). A request
whose client goes away is aborted, which frees its slots in the scheduler.

Nothing the scheduler does (or fails to do) leaves a request waiting forever:
- the receive loop is supervised: if it dies, every pending request fails with a 503 and `unavailable()` (/health)
  stays 503 until the server is restarted (a lost output cannot be told apart from a late one, so it does not
  restart itself);
- the watchdog (--watchdog-timeout): while requests await the scheduler and no step has completed for that long, they
  fail with a 503 naming it and are aborted, and new requests are refused, until a step completes again (the
  scheduler reports every step, outputs or not);
- `watch_process`: the scheduler process died, every request fails with a 503;
- a send to the scheduler waits at most SEND_TIMEOUT_S (ZMQ blocks once the scheduler stops reading and its input
  queue is full); control requests wait for their answer at most their own timeout.
Bounds: with --max-queued-requests N, a request is refused with 429 (Retry-After) while the requests awaiting the
scheduler already fill the running slots and N more; a request whose consumer does not read (a streaming client that
stopped reading) has at most MAX_BUFFERED_TOKENS output tokens waiting, then it is cut off: aborted, its slots freed.
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
    AbortReq, BatchOutput, ClearHiCacheReq, ControlOutput, ExpertDistributionReq, FlushCacheReq, GetWeightsReq,
    MessageCodec, ProfileReq, ReqOutput, SchedulerReady, SchedulerStats, TokenizedGenerateReqInput, UpdateTensorsReq,
    UpdateWeightsReq)
from sglang.srt.managers.output_shaping import OutputState
from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A send to the scheduler blocks once it stopped reading and its input queue is full (ZMQ's high-water mark).
SEND_TIMEOUT_S = 10.0
# Output tokens a request may have waiting for its consumer: beyond it, a streaming client that does not read is cut
# off (the socket's and the server's write buffers are full before this queue grows at all).
MAX_BUFFERED_TOKENS = 4096
SLOW_CLIENT_STATUS = 408  # a stream cut off because its client stopped reading
RETRY_AFTER_S = 1  # the Retry-After of a 429 (a full queue drains as requests finish)


class RequestError(Exception):
    """A request refused (by the endpoint or the scheduler's admission) or that could not finish; carries the
    HTTP status to answer with (and headers, e.g. a 429's Retry-After)."""

    def __init__(self, message: str, status_code: int = 400, param: Optional[str] = None,
                 headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param, self.headers = message, status_code, param, headers


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
    answered: bool = False  # its last output came (or it was failed here): the scheduler owes it nothing more
    buffered: int = 0  # output tokens in `queue`, not yet taken by the consumer


class TokenizerManager:
    def __init__(self, tokenizer, ready: SchedulerReady, scheduler_input: str, tokenizer_input: str,
                 metrics=None, tokenizer_input_remote: Optional[str] = None, *, channel_key: bytes,
                 watchdog_timeout: Optional[float] = None, max_queued_requests: Optional[int] = None) -> None:
        """`channel_key`: the launch's key (PortArgs.channel_key); outputs whose tag it does not verify are dropped
        unread."""
        self.tokenizer = tokenizer
        self.ready = ready
        self.disaggregation_mode = ready.effective_args.get("disaggregation_mode", "null")
        self.metrics = metrics
        self.ctx = ctx = zmq.asyncio.Context()
        self.send = ctx.socket(zmq.PUSH)
        self.send.setsockopt(zmq.LINGER, 0)  # never block process exit on messages to a dead scheduler
        self.send.connect(scheduler_input)
        self.recv = ctx.socket(zmq.PULL)
        self.recv.setsockopt(zmq.LINGER, 0)
        self.recv.bind(tokenizer_input)
        if tokenizer_input_remote:  # DP groups led from other nodes (DP attention over several nodes)
            self.recv.bind(tokenizer_input_remote)  # reachable from the network: every message is verified
        self.codec = MessageCodec(channel_key)
        self.states: dict = {}  # sid -> ReqState
        self.dead_reason: Optional[str] = None
        self.last_stats = ready.stats  # the scheduler's at start, then each step's
        self.group_stats: dict = {}  # DP group -> its latest SchedulerStats
        self.control: dict = {}  # rid -> future of a control request's ControlOutput (io_struct)
        self.updating: Optional[asyncio.Event] = None  # set when a weight update ends; new requests wait for it
        self.weights_path: Optional[str] = None  # the checkpoint of the last weight update (None: the launch's)
        self.watchdog_timeout = watchdog_timeout  # None: no watchdog
        self.max_queued_requests = max_queued_requests  # None: no bound
        self.max_buffered_tokens = MAX_BUFFERED_TOKENS
        self.stalled: Optional[str] = None  # set by the watchdog until the scheduler completes a step again
        self.last_progress = time.perf_counter()  # when the scheduler last reported
        self._loop_task: Optional[asyncio.Task] = None
        self._tasks: set = set()  # the watchdog and aborts sent in the background

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())
            self._loop_task.add_done_callback(self._loop_ended)
            if self.watchdog_timeout:
                self._spawn(self._watchdog())

    def unavailable(self) -> Optional[str]:
        """Why no request can be served now (/health answers 503 with it), or None."""
        return self.dead_reason or self.stalled

    @property
    def running_capacity(self) -> int:
        """Requests the scheduler runs at once: --max-running-requests, per DP group under DP attention."""
        args = self.ready.effective_args or {}
        groups = args.get("dp_size", 1) if args.get("enable_dp_attention") else 1
        return self.ready.max_running_requests * groups

    def check_queue(self) -> None:
        """Refuse a new request (429, Retry-After) when --max-queued-requests requests already wait beside a full
        running batch. Counted here, over the requests awaiting the scheduler (the ones it runs or queues, and any on
        their way): exact whatever the scheduler's latest stats say, and without a round trip."""
        if self.max_queued_requests is None:
            return
        pending = sum(1 for state in self.states.values() if not state.answered)
        capacity = self.running_capacity
        if pending >= capacity + self.max_queued_requests:
            raise RequestError(f"the server is at capacity: {pending} requests are running or queued (at most "
                               f"{capacity} running + {self.max_queued_requests} queued, --max-queued-requests); "
                               f"retry later", 429, headers={"Retry-After": str(RETRY_AFTER_S)})

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
                    await self._abort(state.sid)

    async def generate(self, input_ids: list, params: SamplingParams, return_logprob: bool = False,
                       logprob_start_len: int = -1, top_logprobs_num: int = 0, rid: Optional[str] = None,
                       group: Optional[str] = None,
                       client_gone: Optional[Callable[[], Awaitable[bool]]] = None,
                       bootstrap=None) -> AsyncIterator[GenerationChunk]:
        """Yield a chunk whenever the request makes progress; the last one has finished=True.
        Raises RequestError when the scheduler refuses the request (Scheduler.add_request validates the prompt
        and the sampling params: empty, context length, vocabulary, ...). Cancelling the iteration aborts it.
        `rid`: the client's request id (a 400 while a running request whose client is still there has it); `group`:
        see `abort_matching`; `client_gone`: whether this request's client has disconnected; `bootstrap`: the
        router's pairing of a disaggregated request (disaggregation.messages.BootstrapInfo), carried to the
        scheduler."""
        while self.updating is not None:  # a weight update: requests that arrive meanwhile start after it
            await self.updating.wait()
        if self.unavailable():
            raise RequestError(self.unavailable(), 503)
        self.start()
        if rid is not None:
            await self._free_rid(rid, group)
        self.check_queue()  # with no await before the request is registered
        sid = uuid.uuid4().hex if rid is None else f"{rid}.{uuid.uuid4().hex[:12]}"
        rid = rid or sid
        detok = None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens, params.stop, params.no_stop_trim, params.stop_regex,
            params.min_new_tokens)
        state = ReqState(rid=rid, input_ids=list(input_ids), return_logprob=return_logprob,
                         logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, detok=detok,
                         group=group, sid=sid, client_gone=client_gone,
                         prompt_logprobs_elsewhere=bootstrap is not None and self.disaggregation_mode == "decode")
        self.states[sid] = state
        try:
            try:
                await self._send(TokenizedGenerateReqInput(
                    rid=sid, input_ids=state.input_ids, sampling_params=params, return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                    **({} if bootstrap is None else {"bootstrap_host": bootstrap.host, "bootstrap_port": bootstrap.port,
                                                     "bootstrap_room": bootstrap.room})))
            except RequestError:  # never sent: nothing to abort (an abort would wait as long again)
                state.finished_reason = {"type": "abort"}
                raise
            while True:
                out: ReqOutput = await state.queue.get()
                state.buffered -= len(out.new_token_ids)
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
                await self._abort(sid)
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
            await self._abort(state.sid)
        return [state.rid for state in targets]

    async def flush_cache(self) -> str:
        """Empty the scheduler's prefix cache; its answer once done. RequestError (400) when it refused: requests
        are running there (the HTTP side may not know of all of them yet, or any more)."""
        return (await self._control(FlushCacheReq, timeout=60.0)).message

    async def clear_hicache_storage(self) -> str:
        """Delete the scheduler's file tier files; RequestError (400) when it has none."""
        return (await self._control(ClearHiCacheReq, timeout=60.0)).message

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

    async def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """The first rows of the weight loaded from checkpoint tensor `name` (upstream's /get_weights_by_name), a
        float32 CPU tensor (its lists are the caller's to make, off the event loop)."""
        return (await self._control(lambda rid: GetWeightsReq(rid, name, truncate_size), timeout=60.0)).data

    async def _control(self, make, timeout: float) -> ControlOutput:
        """Send make(rid) to the scheduler and wait for its ControlOutput (the first, under DP attention); RequestError
        with its status when refused."""
        if self.unavailable():
            raise RequestError(self.unavailable(), 503)
        self.start()
        rid = uuid.uuid4().hex
        answer = self.control[rid] = asyncio.get_running_loop().create_future()
        try:
            await self._send(make(rid))
            out: ControlOutput = await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"the scheduler did not answer within {timeout:.0f} s", 503) from None
        finally:
            self.control.pop(rid, None)
        if out.status_code != 200:
            raise RequestError(out.message, out.status_code)
        return out

    # ---- sending -----------------------------------------------------------------------------------------
    async def _send(self, msg) -> None:
        """Send to the scheduler; a 503 when it has not taken messages for SEND_TIMEOUT_S."""
        try:
            await asyncio.wait_for(self.send.send_pyobj(msg), SEND_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RequestError(f"the scheduler has taken no message for {SEND_TIMEOUT_S:.0f} s (its input queue is "
                               f"full); retry later", 503) from None

    async def _abort(self, sid: str) -> None:
        """Abort a request in the scheduler (its slots freed); a scheduler that takes no message is only logged: the
        watchdog or the process watch deals with it."""
        try:
            await self._send(AbortReq(sid))
        except RequestError as e:
            logger.warning("could not abort request %s: %s", sid, e.message)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # referenced until done (the loop keeps only weak references)
        task.add_done_callback(self._tasks.discard)

    # ---- receiving ----------------------------------------------------------------------------------------
    async def _handle_loop(self) -> None:
        while True:
            batch: BatchOutput = self.codec.decode(await self.recv.recv_multipart(), BatchOutput)
            if batch is None:  # not from one of this launch's ranks: dropped unread (and logged)
                continue
            self._dispatch(batch)

    def _dispatch(self, batch: BatchOutput) -> None:
        """One message of the scheduler: a step completed (or messages were answered)."""
        self.last_progress = time.perf_counter()
        if self.stalled is not None:
            logger.warning("the scheduler completed a step again: serving resumes")
            self.stalled = None
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
            if state is None or state.answered:  # gone, or already failed here (cut off, watchdog)
                continue
            if out.finished_reason is not None:
                state.answered = True
            elif state.buffered + len(out.new_token_ids) > self.max_buffered_tokens:
                self._cut_off(state)
                continue
            state.buffered += len(out.new_token_ids)
            state.queue.put_nowait(out)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The receive loop is supervised: anything but close() ending it fails every request and the server."""
        if task.cancelled():
            return
        logger.error("the receive loop from the scheduler failed; every request fails and /health answers 503 "
                     "until the server is restarted", exc_info=task.exception())
        pending = [state.sid for state in self.states.values() if not state.answered]
        self.fail_all("internal error: the server stopped receiving from the scheduler (see the server log); "
                      "restart the server")
        for sid in pending:  # the scheduler still runs them: free their slots
            self._spawn(self._abort(sid))

    def _fail(self, state: ReqState, message: str, status_code: int) -> None:
        """Finish a request here: its consumer gets `message` with `status_code` after the outputs before it."""
        state.answered = True
        state.queue.put_nowait(ReqOutput(
            rid=state.sid, new_token_ids=[], new_logprobs=[], new_top_logprobs=[], prompt_tokens=state.prompt_tokens,
            completion_tokens=0, finished_reason={"type": "abort", "status_code": status_code, "message": message},
            error=message))

    def _cut_off(self, state: ReqState) -> None:
        """A consumer that does not read (a streaming client that stopped): abort the request, freeing its slots,
        rather than buffer its output without bound."""
        message = (f"the client did not read its stream: {state.buffered} output tokens were waiting to be sent "
                   f"(at most {self.max_buffered_tokens}); the request was aborted")
        logger.warning("request %s: %s", state.rid, message)
        self._fail(state, message, SLOW_CLIENT_STATUS)
        state.aborted = True
        self._spawn(self._abort(state.sid))

    # ---- supervision --------------------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        """--watchdog-timeout: requests awaiting a scheduler that completed no step for that long are failed and
        aborted, and the server is unavailable until the scheduler reports again (it reports every step)."""
        timeout = self.watchdog_timeout
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            if self.unavailable():
                continue
            pending = [state for state in self.states.values() if not state.answered]
            if not pending:
                continue
            since = max(self.last_progress, min(state.created for state in pending))  # the clock runs while busy
            idle = time.perf_counter() - since
            if idle > timeout:
                self.stalled = (f"the scheduler has completed no step for {idle:.0f} s while {len(pending)} "
                                f"request(s) awaited it (--watchdog-timeout {timeout:g})")
                logger.error("watchdog: %s; they are aborted, and new requests refused until it completes a step",
                             self.stalled)
                for state in pending:
                    self._fail(state, f"watchdog: the scheduler completed no step in {timeout:g} s "
                                      f"(--watchdog-timeout); the request was aborted", 503)
                    self._spawn(self._abort(state.sid))  # queued: the scheduler frees them when it goes on

    async def watch_process(self, proc, interval: float = 1.0) -> str:
        """Wait until the scheduler process (scheduler_process.SchedulerRanks) exits, then fail every request with
        a 503 naming it; returns why."""
        while proc.is_alive():
            await asyncio.sleep(interval)
        why = proc.describe_exit()
        logger.error("%s", why)
        self.fail_all(f"{why}; restart the server")
        return why

    def close(self) -> None:
        """Stop receiving and release the ZMQ sockets (call from the event loop's thread)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        self.send.close(linger=0)
        self.recv.close(linger=0)
        self.ctx.term()

    def fail_all(self, reason: str) -> None:
        """The scheduler cannot answer any more (its process died, the receive loop failed): answer every waiting
        request with a 503."""
        self.dead_reason = self.dead_reason or reason
        for state in list(self.states.values()):
            if not state.answered:
                self._fail(state, reason, 503)
        for rid, answer in list(self.control.items()):
            if not answer.done():
                answer.set_result(ControlOutput(rid, 503, reason))
