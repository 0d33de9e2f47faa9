"""The decode server's side of a disaggregated request, in its scheduler process: DecodeSide (where the state lands)
meets the bootstrap client (which tells the prefill server where to write, and hears when it has).

A request with the router's bootstrap fields gets its pool pages first (DecodeSide.prealloc); when the pools or the
running limit cannot take it now, it queues here and is retried every loop, in arrival order, until the room timeout
(then a 503). With its pages held, its room is registered with the prefill server named by bootstrap_host /
bootstrap_port: the destination addresses and this server's pool layout. The room's result installs the request (it
decodes from the next step, the first token already its first output) or fails it, freeing its pages, with the
status the bootstrap gives (503 prefill server gone, 504 timed out, 500 prefill failed, 4xx room refused). An abort
of a request waiting for its bytes cancels the room and frees its pages only when the room's result arrives: a write
may still be landing in them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from sglang.srt.disaggregation.bootstrap import BootstrapClient, RoomError
from sglang.srt.disaggregation.decode_side import DecodeSide
from sglang.srt.disaggregation.kv_state import encode_layout, region_addresses
from sglang.srt.disaggregation.messages import BootstrapInfo
from sglang.srt.disaggregation.prefill_side import PrefillResult
from sglang.srt.disaggregation.transfer import TransferQueues, TransferStats
from sglang.srt.managers.schedule_batch import FinishReason, Req
from sglang.srt.mem_cache.allocator import PoolExhaustedError

logger = logging.getLogger(__name__)


@dataclass
class _Queued:
    req: Req
    info: BootstrapInfo
    deadline: float


class DecodeKVManager:
    def __init__(self, scheduler, backend, client: BootstrapClient, room_timeout_s: float) -> None:
        self.scheduler = scheduler
        self.side = DecodeSide(scheduler)
        self.buffers = self.side.buffers()
        self.layout = encode_layout(self.side.layout())
        self.backend = backend
        backend.register(self.buffers)
        self.client = client
        self.room_timeout_s = room_timeout_s
        self.stats = TransferStats()
        self.queue: deque = deque()  # _Queued: waiting for pool pages
        self.started: dict = {}  # room -> (rid, registration time)

    # ---- requests ----------------------------------------------------------------------------------------------
    def add(self, req: Req, info: BootstrapInfo) -> None:
        """Pre-allocate and register `req`'s room, or queue it for pages; ValueError (nothing held) when the request
        can never be served or its room is in use here."""
        if info.room in self.client.rooms or info.room in self.side.rooms or any(
                q.info.room == info.room for q in self.queue):
            raise RoomError(f"bootstrap_room {info.room} is already used by a request on this server; the router "
                            f"draws a fresh room for each request")
        if self.queue:  # in arrival order: an earlier request waits for pages
            self.scheduler.check_request(req)
            self.queue.append(_Queued(req, info, time.perf_counter() + self.room_timeout_s))
            return
        try:
            self._start(req, info)
        except PoolExhaustedError:
            self.queue.append(_Queued(req, info, time.perf_counter() + self.room_timeout_s))

    def _start(self, req: Req, info: BootstrapInfo) -> None:
        regions = self.side.prealloc(req, info.room)
        addrs = region_addresses(self.buffers, regions)
        self.client.register(info, req.rid, [a for a, _ in addrs], [n for _, n in addrs], self.layout)
        self.started[info.room] = (req.rid, time.perf_counter())

    def owns(self, rid: str) -> bool:
        """Whether `rid` waits here (for pages or bytes): its abort goes through `abort`, not the scheduler."""
        return any(q.req.rid == rid for q in self.queue) or any(r == rid for r, _ in self.started.values())

    def abort(self, rid: str):
        """A queued request ends now (returned, for the caller to report); one waiting for its bytes cancels its
        room and ends when the room's result comes (None now)."""
        for q in self.queue:
            if q.req.rid == rid:
                self.queue.remove(q)
                q.req.finished_reason = FinishReason("abort", message="request aborted")
                return q.req
        room = next((room for room, (r, _) in self.started.items() if r == rid), None)
        if room is not None:
            self.client.cancel(room, "the request was aborted on the decode server")
        return None

    # ---- the loop ----------------------------------------------------------------------------------------------
    def poll(self) -> list:
        """Retry the queue, install or fail the rooms whose result came; returns requests that ended here without
        reaching the scheduler (for the caller to report)."""
        reported = []
        now = time.perf_counter()
        while self.queue:
            q = self.queue[0]
            if now > q.deadline:
                self.queue.popleft()
                q.req.finished_reason = FinishReason("abort", status_code=503, message=(
                    f"the decode server's KV pool had no room for this request within {self.room_timeout_s:g} s"))
                reported.append(q.req)
                continue
            try:
                self._start(q.req, q.info)
            except PoolExhaustedError:
                break
            except ValueError as e:
                q.req.finished_reason = FinishReason("abort", status_code=400, message=str(e))
                reported.append(q.req)
            self.queue.popleft()
        for result in self.client.poll():
            self._on_result(result, now)
        return reported

    def _on_result(self, result, now: float) -> None:
        _, started = self.started.pop(result.room, (None, now))
        if result.room not in self.side.rooms:  # freed already (its grammar failed)
            return
        if not result.ok:
            self.stats.num_failures += result.status_code >= 500
            self.side.fail(result.room, result.error or "the prefill server failed the request", result.status_code)
            return
        top = result.first_token_top_logprobs
        first = PrefillResult(
            result.first_token_id, result.first_token_logprob if result.first_token_logprob is not None else 0.0,
            None if top is None else [(lp, t) for lp, t in top],
            None if result.generator_state is None else bytes.fromhex(result.generator_state), result.finished)
        self.stats.num_transfers += 1
        self.stats.bytes += result.nbytes
        self.stats.latencies.append(now - started)
        try:
            self.side.install(result.room, first)
        except Exception as e:  # a state that cannot continue here: this request fails, the server goes on
            logger.exception("installing room %s failed", result.room)
            if result.room in self.side.rooms:
                self.side.fail(result.room, f"installing the prefilled state failed: {e}")

    # ---- what the loop and the stats read ---------------------------------------------------------------------
    def has_pending(self) -> bool:
        return bool(self.queue or self.started)

    def idle_wait_ms(self) -> int:
        """Queued requests retry every few ms (pages free as others finish); rooms waiting for bytes wake the loop
        through the bootstrap sockets; a second bounds the wait for the rooms' timeouts."""
        return 5 if self.queue else 1000

    def sockets(self) -> list:
        return self.client.sockets()

    def queues(self) -> TransferQueues:
        return TransferQueues("decode", waiting=len(self.queue), transferring=self.side.num_pending)

    def close(self) -> None:
        self.client.close()
        self.backend.close()
