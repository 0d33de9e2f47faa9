"""The decode server's side of a disaggregated request, in its scheduler process: DecodeSide (where the state lands)
meets the bootstrap client (which tells the prefill server where to write, and hears when it has).

A request with the router's bootstrap fields gets its pool pages first (DecodeSide.prealloc); when the pools or the
running limit cannot take it now, it queues here and is retried every loop, in arrival order, until the room timeout
(then a 503). With its pages held, its room is registered with the prefill server named by bootstrap_host /
bootstrap_port: the destination addresses and this server's pool layout. The room's result installs the request (it
decodes from the next step, the first token already its first output) or fails it, freeing its pages, with the
status the bootstrap gives (503 prefill server gone, 504 timed out, 500 prefill failed, 4xx room refused). An abort
of a request waiting for its bytes cancels the room and frees its pages only when the room's result arrives: a write
may still be landing in them. After any failure but a refusal the pages stay held a while longer
(SGLANG_DISAGGREGATION_LATE_WRITE_HOLD) before reuse: a write that timed out may land late.

With --tp-size > 1 every rank pre-allocates the request alike (the ranks' schedulers run in lockstep) and the first
rank alone holds the bootstrap client: it registers the room with the destinations on every rank (each rank's own
buffers, exchanged once at start: ranks.RankBuffers) and hands what it hears to the other ranks, so a room is
installed, failed or freed on all of them in the same loop (disaggregation/ranks.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from sglang.srt.disaggregation.bootstrap import BootstrapClient, RoomError
from sglang.srt.disaggregation.decode_side import DecodeSide
from sglang.srt.disaggregation.kv_state import encode_layout
from sglang.srt.disaggregation.messages import BootstrapInfo
from sglang.srt.disaggregation.prefill_side import PrefillResult
from sglang.srt.disaggregation.ranks import RankBuffers, RankReport, rank_destinations
from sglang.srt.disaggregation.transfer import TransferQueues, TransferStats
from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.managers.schedule_batch import FinishReason, Req
from sglang.srt.mem_cache.allocator import PoolExhaustedError

logger = logging.getLogger(__name__)


@dataclass
class _Queued:
    req: Req
    info: BootstrapInfo
    deadline: float


class DecodeKVManager:
    def __init__(self, scheduler, backend, client: Optional[BootstrapClient], room_timeout_s: float,
                 ranks: Optional[GroupCoordinator] = None, late_write_hold_s: float = 0.0) -> None:
        self.scheduler = scheduler
        self.side = DecodeSide(scheduler)
        self.buffers = self.side.buffers()
        self.layout = encode_layout(self.side.layout())
        self.backend = backend
        backend.register(self.buffers)
        self.ranks = ranks or GroupCoordinator((0,), 0)
        if (client is None) != (self.ranks.rank_in_group > 0):
            raise ValueError("the bootstrap client runs on the first rank of a decode server, and there only")
        self.client = client  # the first rank's only
        # every rank's session and buffers (a collective: every rank builds its manager at the same point)
        self.rank_buffers = self.ranks.all_gather_object(RankBuffers(backend.session_id, self.buffers))
        self.ranks_pools_free = False  # every rank's pools free, as of the last loop's reports
        self.room_timeout_s = room_timeout_s
        self.stats = TransferStats()
        self.queue: deque = deque()  # _Queued: waiting for pool pages
        self.started: dict = {}  # room -> (rid, registration time)
        self.late_write_hold_s = late_write_hold_s  # side.held's times: the first rank's clock decides

    # ---- requests ----------------------------------------------------------------------------------------------
    def claim_room(self, room: int, rid: str) -> None:
        """Nothing to claim ahead of the ranks: a room in use here is refused by `add`, alike on every rank."""
        return None

    def add(self, req: Req, info: BootstrapInfo) -> None:
        """Pre-allocate and register `req`'s room, or queue it for pages; ValueError (nothing held) when the request
        can never be served or its room is in use here."""
        if info.room in self.started or info.room in self.side.rooms or any(
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
        if self.client is not None:
            lengths, dests = rank_destinations(self.rank_buffers, regions)
            self.client.register(info, req.rid, dests[0][1], lengths, self.layout,
                                 rank_destinations=[[session, addrs] for session, addrs in dests[1:]])
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
        if room is not None and self.client is not None:
            self.client.cancel(room, "the request was aborted on the decode server")
        return None

    # ---- the loop ----------------------------------------------------------------------------------------------
    def poll(self) -> list:
        """Retry the queue, install or fail the rooms whose result came; returns requests that ended here without
        reaching the scheduler (for the caller to report). Every rank calls it once a loop (a collective): the first
        rank's view of the deadlines and of the prefill servers is every rank's."""
        reported = []
        now = time.perf_counter()
        report = RankReport(pools_free=self.scheduler.allocator.is_all_free())
        if self.client is not None:
            report.expired = [q.info.room for q in self.queue if now > q.deadline]
            report.results = self.client.poll()
            report.released = sum(1 for until, _ in self.side.held if until <= now)
        reports = self.ranks.all_gather_object(report)
        self.ranks_pools_free = all(r.pools_free for r in reports)
        self.side.release_held(reports[0].released)
        expired = set(reports[0].expired)
        while self.queue:
            q = self.queue[0]
            if q.info.room in expired:
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
        for result in reports[0].results:
            self._on_result(result, now)
        return reported

    def _on_result(self, result, now: float) -> None:
        _, started = self.started.pop(result.room, (None, now))
        if result.room not in self.side.rooms:  # freed already (its grammar failed)
            return
        if not result.ok:
            self.stats.num_failures += result.status_code >= 500
            # a refused room (4xx) was never written; after any other failure a write may still land: a TCP peer's
            # bytes queued in a socket, an engine call that outlived its bound (transfer.run_bounded)
            hold = self.late_write_hold_s > 0 and (result.status_code >= 500 or result.status_code == 499)
            self.side.fail(result.room, result.error or "the prefill server failed the request", result.status_code,
                           hold_until=now + self.late_write_hold_s if hold else None)
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
        return bool(self.queue or self.started or self.side.held)

    def idle_wait_ms(self) -> int:
        """Queued requests retry every few ms (pages free as others finish); rooms waiting for bytes wake the loop
        through the bootstrap sockets; a second bounds the wait for the rooms' timeouts and held pages."""
        return 5 if self.queue else 1000

    def sockets(self) -> list:
        return self.client.sockets() if self.client is not None else []

    def queues(self) -> TransferQueues:
        return TransferQueues("decode", waiting=len(self.queue), transferring=self.side.num_pending)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.backend.close()
