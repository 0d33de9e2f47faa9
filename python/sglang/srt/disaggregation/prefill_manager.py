"""The prefill server's side of a disaggregated request, in its scheduler process: PrefillSide (what travels) meets
the bootstrap server (who waits for it) and the transfer backend (how it moves).

A request with the router's bootstrap fields is expected under its room and scheduled as any other. Once its first
token is sampled, PrefillSide exports it; the export waits here for the decode server's registration of the room
(at most --disaggregation room timeout: the bootstrap server then fails it), the decode side's pool layout is checked
against this one's, and the request's regions, paired with the registration's destinations, are written to the
decode server's transfer session. The write runs on a worker thread: the scheduler loop goes on with the next
prefill chunks meanwhile (the held request's pages are out of every batch, so nothing writes them), and a long
prompt's transfer overlaps the next prompt's prefill instead of stalling it. A finished write ends the request here
(its prompt goes to the prefix cache) and tells the decode server the first token; a failed one fails both halves.

With --tp-size > 1 every rank runs one of these over its own pools and transfer session; the first rank alone holds
the bootstrap server (disaggregation/ranks.py says how the ranks agree). Each rank writes its copy of the request's
bytes to the decode ranks it serves (ranks.decode_targets); the room completes, or fails, on every rank once every
rank's write has ended, and only then does the first rank tell the decode server.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from sglang.srt.disaggregation.bootstrap import BootstrapServer, RoomError
from sglang.srt.disaggregation.kv_state import check_same_layout, decode_layout, pair_regions, region_addresses
from sglang.srt.disaggregation.messages import BootstrapInfo, RoomRegistration
from sglang.srt.disaggregation.prefill_side import PrefillExport, PrefillSide
from sglang.srt.disaggregation.ranks import RankReport, decode_targets, first_error
from sglang.srt.disaggregation.transfer import DEFAULT_WRITE_TIMEOUT_S, TransferError, TransferQueues, TransferStats
from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.managers.schedule_batch import FinishReason, Req

logger = logging.getLogger(__name__)

WRITE_WORKERS = 2  # writes in flight at once: one long prompt's transfer does not queue a short one's
ABORTED = "request aborted on the prefill server"


@dataclass
class _Inflight:
    """A room being written: this rank's write (a Future of (seconds, error)), and the ranks whose writes ended."""

    ex: PrefillExport
    write: concurrent.futures.Future
    decode_tp: int
    reported: bool = False  # this rank's end was handed to the others
    aborted: bool = False  # the request was aborted meanwhile: the room fails once the writes end
    errors: dict = field(default_factory=dict)  # rank -> error (None: landed), of the ranks whose writes ended


def _done(seconds: float, error: Optional[str]) -> concurrent.futures.Future:
    fut = concurrent.futures.Future()
    fut.set_result((seconds, error))
    return fut


class PrefillKVManager:
    def __init__(self, scheduler, backend, server: Optional[BootstrapServer],
                 ranks: Optional[GroupCoordinator] = None, write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        self.scheduler = scheduler
        self.side = PrefillSide(scheduler)
        self.buffers = self.side.buffers()
        self.layout = self.side.layout()
        self.backend = backend
        backend.register(self.buffers)
        self.ranks = ranks or GroupCoordinator((0,), 0)
        self.rank = self.ranks.rank_in_group
        self.server = server  # the first rank's only
        if (server is None) != (self.rank > 0):
            raise ValueError("the bootstrap server runs on the first rank of a prefill server, and there only")
        self.write_timeout_s = write_timeout_s
        self.stats = TransferStats()
        self.waiting: dict = {}  # room -> PrefillExport waiting for the decode server's registration
        self.inflight: dict = {}  # room -> _Inflight
        self.ended: set = set()  # rooms the bootstrap server failed before their export came
        self.ranks_pools_free = False  # every rank's pools free, as of the last loop's reports
        self._writer = concurrent.futures.ThreadPoolExecutor(WRITE_WORKERS, thread_name_prefix="kv-transfer")
        self._on_gpu = scheduler.runner.device.type == "cuda"

    # ---- requests ----------------------------------------------------------------------------------------------
    def claim_room(self, room: int, rid: str) -> Optional[RoomError]:
        """The first rank, as a request arrives and before every rank admits it: expect `rid` under `room`. Returns
        the refusal (a room in use or used before), which every rank then answers alike."""
        try:
            self.server.expect(room, rid)
        except RoomError as e:
            return e
        return None

    def add(self, req: Req, info: BootstrapInfo) -> None:
        """Queue `req`, whose room the first rank claimed; ValueError (the decode side is told too) when the room is
        in use or the request can never be served."""
        try:
            self.side.add_request(req, info.room)
        except ValueError as e:
            if self.server is not None:
                self.server.fail(info.room, str(e), status_code=400)
            raise

    def owns(self, rid: str) -> bool:
        """Whether `rid` was prefilled and waits here for its room's registration or write: its abort goes through
        `abort` (others are the scheduler's)."""
        self._take_exports()
        return any(ex.rid == rid for ex in self.waiting.values()) or any(
            e.ex.rid == rid for e in self.inflight.values())

    def abort(self, rid: str) -> None:
        """A prefilled request aborted here: one waiting for its registration is freed now, one being written when
        every rank's write has ended (the pages are read until then); the decode server is told either way. The
        request is returned by the next step."""
        room = next((r for r, ex in self.waiting.items() if ex.rid == rid), None)
        if room is not None:
            self._end(self.waiting.pop(room), ABORTED)
            return None
        entry = next(e for e in self.inflight.values() if e.ex.rid == rid)
        entry.aborted = True
        return None

    # ---- the loop ----------------------------------------------------------------------------------------------
    def poll(self) -> list:
        """Read the bootstrap server (first rank), agree with the other ranks, start the writes whose registration
        came, end the rooms every rank has written; returns requests finished here outside a step (for the caller
        to report). Every rank calls it once a loop (a collective)."""
        self._take_exports()
        report = RankReport(pools_free=self.scheduler.allocator.is_all_free())
        for room, entry in self.inflight.items():
            if not entry.reported and entry.write.done():
                entry.reported = True
                report.written[room] = entry.write.result()[1]
        if self.server is not None:
            events = self.server.poll()
            report.failed = events.failed
            report.ready = [self.server.take(room) for room in self.waiting
                            if self.server.registration(room) is not None]
        reports = self.ranks.all_gather_object(report)
        self.ranks_pools_free = all(r.pools_free for r in reports)
        reported = []
        for room, why in reports[0].failed:
            reported += self._room_failed(room, why)
        for reg in reports[0].ready:
            self._start(self.waiting.pop(reg.room), reg)
        for rank, r in enumerate(reports):
            for room, error in r.written.items():
                self.inflight[room].errors[rank] = error
        for room in [r for r, e in self.inflight.items() if len(e.errors) == self.ranks.world_size]:
            self._finish(room)
        return reported

    def _take_exports(self) -> None:
        for ex in self.side.pop_exports():
            if ex.room in self.ended:  # its room already failed: the request was ended with it
                self.ended.discard(ex.room)
            elif ex.error is not None:
                if self.server is not None:
                    self.server.fail(ex.room, ex.error)
            else:
                self.waiting[ex.room] = ex

    def _room_failed(self, room: int, why: str) -> list:
        """No decode server registered the room in time, or it cancelled: end the request here."""
        ex = self.waiting.pop(room, None)
        if ex is not None:
            if _holds_pages(ex):
                self.side.finish_transfer(room, why)
            return []
        rid = next((rid for rid, r in self.side.rooms.items() if r == room), None)
        if rid is None:
            return []
        self.ended.add(room)  # its export (with the abort's error) is dropped when it comes
        req = self.scheduler.abort_request(rid)
        if req is None:
            return []
        req.finished_reason = FinishReason("abort", status_code=503, message=why)
        return [req]

    def _start(self, ex: PrefillExport, reg: RoomRegistration) -> None:
        try:
            check_same_layout(self.layout, decode_layout(reg.layout))
        except ValueError as e:
            msg = f"the decode server pools differently from this prefill server: {e}"
            logger.error("room %s: %s", ex.room, msg)
            return self._end(ex, msg)
        if not _holds_pages(ex):  # the first token ended it: the decode side needs only that
            return self._end(ex, None)
        dests = reg.destinations()
        plans = []
        try:
            src = region_addresses(self.buffers, ex.regions)
            for rank in decode_targets(self.rank, self.ranks.world_size, len(dests)):
                session, addrs = dests[rank]
                plans.append((session, pair_regions(src, list(zip(addrs, reg.lengths)))))
        except ValueError as e:  # this rank's failure: the room fails on every rank once each has reported
            write = _done(0.0, f"the decode server's pages do not match this request's state: {e}")
        else:
            if self._on_gpu and plans:  # the step's last writes (the MTP draft state) must have landed first
                import torch

                torch.cuda.current_stream().synchronize()
            write = self._writer.submit(self._write, plans) if plans else _done(0.0, None)
        self.inflight[ex.room] = _Inflight(ex, write, len(dests))

    def _write(self, plans: list) -> tuple:
        """On a worker thread: every (session, TransferPlan) of this rank, in turn; (seconds, error or None)."""
        start = time.perf_counter()
        for session, plan in plans:
            try:
                self.backend.write(session, plan.src_addrs, plan.dst_addrs, plan.lengths, self.write_timeout_s)
            except TransferError as e:
                return time.perf_counter() - start, str(e)
            except Exception as e:  # the engine's own failure: the request fails, the server goes on
                logger.exception("KV write to %s failed", session)
                return time.perf_counter() - start, f"{type(e).__name__}: {e}"
        return time.perf_counter() - start, None

    def _finish(self, room: int) -> None:
        entry = self.inflight.pop(room)
        seconds = entry.write.result()[0]
        error = first_error(entry.errors) or (ABORTED if entry.aborted else None)
        nbytes = sum(r.nbytes for r in entry.ex.regions) * entry.decode_tp  # every decode rank got a copy
        if error is None:
            self.stats.num_transfers += 1
            self.stats.bytes += nbytes
            self.stats.latencies.append(seconds)
        else:
            self.stats.num_failures += 1
            logger.warning("room %s: KV write failed: %s", room, error)
        self._end(entry.ex, error, nbytes)

    def _end(self, ex: PrefillExport, error: Optional[str], nbytes: int = 0) -> None:
        req = self.side.finish_transfer(ex.room, error) if _holds_pages(ex) else None
        if self.server is None:
            return
        if error is not None:
            self.server.fail(ex.room, error)
            return
        r = ex.result
        self.server.complete(
            ex.room, r.first_token, r.logprob, nbytes, req.cached_tokens if req is not None else 0,
            top_logprobs=None if r.top_logprobs is None else [[float(lp), int(t)] for lp, t in r.top_logprobs],
            generator_state=None if r.generator_state is None else r.generator_state.hex(), finished=r.finished)

    # ---- what the loop and the stats read ---------------------------------------------------------------------
    def has_pending(self) -> bool:
        return bool(self.waiting or self.inflight)

    def idle_wait_ms(self) -> int:
        """How long the loop may wait for input when it has no step to run: short while a write is in flight (its
        end is no socket event), else until a message comes (the bootstrap socket wakes it) or a second passed."""
        return 2 if self.inflight else 1000

    def sockets(self) -> list:
        return [self.server.sock] if self.server is not None else []

    def queues(self) -> TransferQueues:
        return TransferQueues("prefill", waiting=len(self.waiting), transferring=len(self.inflight))

    def close(self) -> None:
        self._writer.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
        self.backend.close()


def _holds_pages(ex: PrefillExport) -> bool:
    return ex.result is not None and not ex.result.finished

