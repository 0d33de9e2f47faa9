"""DecodeSide: the Scheduler of a decode server (--disaggregation-mode decode).

`prealloc(req, room)` validates a request as the Scheduler would, gives it a request slot, the pages of its prompt
and the window slots of the prompt's last W - 1 positions (PoolExhaustedError, nothing held, when the pools or the
running limit cannot take it now), and returns the destination Regions the prefill side writes (a constrained request
meanwhile compiles its grammar). Once the bytes have arrived, `install(room, result)` makes the request a running one
with its prompt computed and the first token as its first output (sampling parameters, stop conditions, grammar,
logprobs, a seeded generator and, under speculative decoding, the MTP draft state as the prefill side left them), so
the next decode step continues it exactly as a co-located server would. `fail(room, ...)` (the prefill side died,
timed out or failed) and an abort free every slot the room holds (after a failure a write may still land: those
slots are held a while first). Requests finished here outside a step are returned by the next step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.disaggregation.kv_state import (
    DraftStateBuffers, RequestKV, dest_regions, layout_signature, transfer_buffers, window_tail)
from sglang.srt.disaggregation.prefill_side import PrefillResult
from sglang.srt.managers.schedule_batch import FinishReason, Req
from sglang.srt.managers.schedule_policy import expected_tokens
from sglang.srt.mem_cache.allocator import PoolExhaustedError
from sglang.srt.speculative.eagle_worker import SpecState


@dataclass
class DecodeRoom:
    room: int
    req: Req
    kv: RequestKV
    grammar_pending: bool  # its grammar still compiles
    result: Optional[PrefillResult] = None  # set when the bytes and the notice have arrived
    created_time: float = 0.0


class DecodeSide:
    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.pool = scheduler.runner.token_to_kv_pool
        self.draft = DraftStateBuffers.for_runner(scheduler.runner) if scheduler.worker.speculative else None
        self.rooms: dict = {}  # room -> DecodeRoom pre-allocated, not installed yet
        self.finished: list = []  # requests finished outside a step: returned by the next one
        self.held: deque = deque()  # (until when, slots) of failed rooms kept from reuse a while, oldest first
        scheduler.disagg = self

    def buffers(self) -> list:
        """Every buffer a transfer may write (register them once with the transfer engine)."""
        return transfer_buffers(self.pool, self.draft)

    def layout(self) -> tuple:
        return layout_signature(self.pool, self.draft)

    @property
    def num_pending(self) -> int:
        """Rooms pre-allocated and waiting for their bytes (the decode side's transfer queue depth)."""
        return len(self.rooms)

    # ---- a room's life -----------------------------------------------------------------------------------------
    def prealloc(self, req: Req, room: int) -> list:
        """Hold the slots `req`'s prompt needs and return their destination Regions. ValueError for a request that
        can never be served or a room in use; PoolExhaustedError when it cannot be taken now (nothing held)."""
        sched, allocator = self.scheduler, self.scheduler.allocator
        if room in self.rooms:
            raise ValueError(f"bootstrap_room {room} is already in use on this decode server")
        sched.check_request(req)
        if len(sched.running) + len(self.rooms) >= sched.max_running:
            raise PoolExhaustedError("running request", 1, 0)
        ratio, clip, draft = sched.new_token_ratio.value, sched.clip_max_new_tokens, sched.num_draft_tokens
        held = list(sched.running) + [r.req for r in self.rooms.values()]
        budget = allocator.available_pages() - sum(
            allocator.pages_needed(r.alloc, expected_tokens(r, ratio, clip, draft)) for r in held)
        need = allocator.pages_needed(None, expected_tokens(req, 1.0, clip, draft))
        if need > budget:
            raise PoolExhaustedError(allocator.pages.name, need, max(0, budget))
        n = len(req.origin_input_ids)
        alloc = allocator.alloc_req()
        try:
            allocator.place_prefilled(alloc, n, n - window_tail(self.pool.config.sliding_window, n))
        except BaseException:
            allocator.free_req(alloc)
            raise
        req.alloc = alloc
        ps = allocator.page_size
        kv = RequestKV(alloc.req_pool_idx, n, tuple(alloc.pages), tuple(alloc.window_slots),
                       draft=self.draft is not None, draft_probs=self.draft is not None
                       and not req.sampling_params.is_greedy)
        assert len(kv.pages) == -(-n // ps)
        params = req.sampling_params
        if params.grammar is not None:
            sched._grammar_queue().submit(req, *params.grammar, time.perf_counter())
        self.rooms[room] = DecodeRoom(room, req, kv, params.grammar is not None, created_time=time.perf_counter())
        return dest_regions(self.pool, kv, self.draft)

    def install(self, room: int, result: PrefillResult) -> Optional[Req]:
        """The room's bytes have arrived: the request decodes from the next step on (once its grammar compiled).
        Returns it when installed now, else None. ValueError for an unknown room or one that already arrived."""
        entry = self.rooms.get(room)
        if entry is None:
            raise ValueError(f"bootstrap_room {room} is not pre-allocated on this decode server")
        if entry.result is not None:
            raise ValueError(f"bootstrap_room {room} already received its prefill")
        entry.result = result
        if entry.grammar_pending:
            return None
        return self._install(entry)

    def _install(self, entry: DecodeRoom) -> Req:
        sched, req, result = self.scheduler, entry.req, entry.result
        del self.rooms[entry.room]
        req.num_computed = entry.kv.num_tokens
        req.prompt_cached = True  # the prefill server's cache holds the prompt; this one caches what it decodes
        req.admitted_time = req.admitted_time or time.perf_counter()
        if result.generator_state is not None and req.generator is not None:
            req.generator.set_state(torch.tensor(list(result.generator_state), dtype=torch.uint8))
        if entry.kv.draft and not result.finished:
            req.spec = SpecState(*self.draft.load(req.alloc.req_pool_idx, entry.kv.draft_probs))
            req.draft_len = entry.kv.num_tokens
        sched.append_token(req, result.first_token, result.logprob, result.top_logprobs)
        if result.finished and not req.finished:  # no KV came: it cannot go on here
            req.finished_reason = FinishReason("abort", status_code=500, message="the prefill server finished the "
                                               "request at its first token but this server would continue it")
        if req.finished:
            sched.free_request(req)
            self.finished.append(req)
        else:
            sched.running.append(req)
        return req

    def fail(self, room: int, message: str, status_code: int = 500, hold_until: Optional[float] = None) -> Req:
        """The room's prefill failed (the prefill server died, timed out or reported an error): finish the request
        with `status_code` and free its slots, now or, with `hold_until` (a write may still land in its pages), when
        `release_held` says."""
        entry = self.rooms.get(room)
        if entry is None:
            raise ValueError(f"bootstrap_room {room} is not pre-allocated on this decode server")
        req = self._drop(entry)
        req.finished_reason = FinishReason("abort", message=message, status_code=status_code)
        if hold_until is not None:
            self.held.append((hold_until, req.alloc))
            req.alloc = None  # the scheduler forgets the request; its slots wait in `held`
        self.scheduler.free_request(req)
        self.finished.append(req)
        return req

    def release_held(self, count: int) -> None:
        """Free the slots of the `count` oldest held rooms (every rank releases alike, as the first rank's clock
        says: decode_manager)."""
        for _ in range(count):
            self.scheduler.allocator.free_req(self.held.popleft()[1])

    def _drop(self, entry: DecodeRoom) -> Req:
        del self.rooms[entry.room]
        if entry.grammar_pending and self.scheduler.grammar_queue is not None:
            self.scheduler.grammar_queue.remove(entry.req.rid)
        return entry.req

    def expired_rooms(self, timeout_s: float, now: Optional[float] = None) -> list:
        """Rooms pre-allocated more than timeout_s ago whose bytes have not arrived (for the caller to `fail`)."""
        now = time.perf_counter() if now is None else now
        return [e.room for e in self.rooms.values() if e.result is None and now - e.created_time > timeout_s]

    # ---- Scheduler hooks ---------------------------------------------------------------------------------------
    def abort(self, rid: str) -> Optional[Req]:
        """A request waiting for its bytes: freed and finished as aborted; None for any other."""
        entry = next((e for e in self.rooms.values() if e.req.rid == rid), None)
        if entry is None:
            return None
        req = self._drop(entry)
        req.finished_reason = FinishReason("abort", message="request aborted")
        self.scheduler.free_request(req)
        return req

    def after_step(self, updated: list) -> list:
        finished, self.finished = self.finished, []
        return updated + finished

    def has_work(self) -> bool:
        return bool(self.finished)

    def grammar_ready(self, ready: list) -> list:
        """Of the requests whose grammar compiled, install those of rooms whose bytes arrived; the others of rooms
        wait for their bytes; returns those of no room (for the waiting queue)."""
        by_rid = {e.req.rid: e for e in self.rooms.values()}
        rest = []
        for req in ready:
            entry = by_rid.get(req.rid)
            if entry is None:
                rest.append(req)
                continue
            entry.grammar_pending = False
            if entry.result is not None:
                self._install(entry)
        return rest

    def grammar_refused(self, req: Req) -> None:
        """A room's grammar does not compile: its slots are freed (the step returns the request with the reason)."""
        entry = next((e for e in self.rooms.values() if e.req.rid == req.rid), None)
        if entry is not None:
            del self.rooms[entry.room]
            self.scheduler.free_request(req)
