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
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Optional

from sglang.srt.disaggregation.bootstrap import BootstrapServer
from sglang.srt.disaggregation.kv_state import check_same_layout, decode_layout, pair_regions, region_addresses
from sglang.srt.disaggregation.messages import BootstrapInfo
from sglang.srt.disaggregation.prefill_side import PrefillExport, PrefillSide
from sglang.srt.disaggregation.transfer import DEFAULT_WRITE_TIMEOUT_S, TransferError, TransferQueues, TransferStats
from sglang.srt.managers.schedule_batch import FinishReason, Req

logger = logging.getLogger(__name__)

WRITE_WORKERS = 2  # writes in flight at once: one long prompt's transfer does not queue a short one's


class PrefillKVManager:
    def __init__(self, scheduler, backend, server: BootstrapServer,
                 write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        self.scheduler = scheduler
        self.side = PrefillSide(scheduler)
        self.buffers = self.side.buffers()
        self.layout = self.side.layout()
        self.backend = backend
        backend.register(self.buffers)
        self.server = server
        self.write_timeout_s = write_timeout_s
        self.stats = TransferStats()
        self.waiting: dict = {}  # room -> PrefillExport waiting for the decode server's registration
        self.inflight: dict = {}  # room -> (PrefillExport, Future of the write)
        self.ended: set = set()  # rooms the bootstrap server failed before their export came
        self._writer = concurrent.futures.ThreadPoolExecutor(WRITE_WORKERS, thread_name_prefix="kv-transfer")
        self._on_gpu = scheduler.runner.device.type == "cuda"

    # ---- requests ----------------------------------------------------------------------------------------------
    def add(self, req: Req, info: BootstrapInfo) -> None:
        """Expect `req` under its room and queue it; RoomError / ValueError (the decode side is told too) when the
        room is in use or the request can never be served."""
        self.server.expect(info.room, req.rid)
        try:
            self.side.add_request(req, info.room)
        except ValueError as e:
            self.server.fail(info.room, str(e), status_code=400)
            raise

    def owns(self, rid: str) -> bool:
        return False  # every request of this side is in the scheduler: its abort goes through PrefillSide

    # ---- the loop ----------------------------------------------------------------------------------------------
    def poll(self) -> list:
        """Read the bootstrap server, start the writes whose registration came, end those that finished; returns
        requests finished here outside a step (for the caller to report)."""
        reported = []
        events = self.server.poll()
        for room, why in events.failed:
            reported += self._room_failed(room, why)
        for ex in self.side.pop_exports():
            if ex.room in self.ended:  # its room already failed: the request was ended with it
                self.ended.discard(ex.room)
            elif ex.error is not None:
                self.server.fail(ex.room, ex.error)
            else:
                self.waiting[ex.room] = ex
        for room in [r for r in self.waiting if self.server.registration(r) is not None]:
            self._start(self.waiting.pop(room))
        for room in [r for r, (_, fut) in self.inflight.items() if fut.done()]:
            self._finish(room)
        return reported

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

    def _start(self, ex: PrefillExport) -> None:
        reg = self.server.take(ex.room)
        try:
            check_same_layout(self.layout, decode_layout(reg.layout))
        except ValueError as e:
            msg = f"the decode server pools differently from this prefill server: {e}"
            logger.error("room %s: %s", ex.room, msg)
            return self._end(ex, msg)
        if not _holds_pages(ex):  # the first token ended it: the decode side needs only that
            return self._end(ex, None)
        try:
            plan = pair_regions(region_addresses(self.buffers, ex.regions), list(zip(reg.dst_addrs, reg.lengths)))
        except ValueError as e:
            return self._end(ex, f"the decode server's pages do not match this request's state: {e}")
        if self._on_gpu:  # the step's last writes (the MTP draft state) must have landed before the engine reads
            import torch

            torch.cuda.current_stream().synchronize()
        fut = self._writer.submit(self._write, reg.session_id, plan)
        self.inflight[ex.room] = (ex, fut)

    def _write(self, session: str, plan) -> tuple:
        """On a worker thread: (seconds, error or None)."""
        start = time.perf_counter()
        try:
            self.backend.write(session, plan.src_addrs, plan.dst_addrs, plan.lengths, self.write_timeout_s)
        except TransferError as e:
            return time.perf_counter() - start, str(e)
        except Exception as e:  # the engine's own failure: the request fails, the server goes on
            logger.exception("KV write to %s failed", session)
            return time.perf_counter() - start, f"{type(e).__name__}: {e}"
        return time.perf_counter() - start, None

    def _finish(self, room: int) -> None:
        ex, fut = self.inflight.pop(room)
        seconds, error = fut.result()
        nbytes = sum(r.nbytes for r in ex.regions)
        if error is None:
            self.stats.num_transfers += 1
            self.stats.bytes += nbytes
            self.stats.latencies.append(seconds)
        else:
            self.stats.num_failures += 1
            logger.warning("room %s: KV write failed: %s", room, error)
        self._end(ex, error, nbytes)

    def _end(self, ex: PrefillExport, error: Optional[str], nbytes: int = 0) -> None:
        req = self.side.finish_transfer(ex.room, error) if _holds_pages(ex) else None
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
        return [self.server.sock]

    def queues(self) -> TransferQueues:
        return TransferQueues("prefill", waiting=len(self.waiting), transferring=len(self.inflight))

    def close(self) -> None:
        self._writer.shutdown(wait=False, cancel_futures=True)
        self.server.close()
        self.backend.close()


def _holds_pages(ex: PrefillExport) -> bool:
    return ex.result is not None and not ex.result.finished

