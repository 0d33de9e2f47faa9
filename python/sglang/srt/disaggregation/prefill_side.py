"""PrefillSide: the Scheduler of a prefill server (--disaggregation-mode prefill).

A request registered with its bootstrap room is scheduled like any other until its prompt is prefilled and its first
token sampled (with its logprob; under speculative decoding the MTP draft has also extended over the prompt). The
step then takes it out of the running set, keeping every page and window slot it holds, and queues a PrefillExport:
its source Regions (disaggregation/kv_state.py) and the PrefillResult the decode side continues from. Whoever moves
the bytes calls `finish_transfer`; the request then ends here as a finished one would (its prompt goes to the prefix
cache) or, when the transfer failed, as failed, and the next step returns it. A request whose first token already
ends it (EOS, max_new_tokens = 1) is exported with no Regions: the decode side needs only the token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.disaggregation.kv_state import (
    DraftStateBuffers, RequestKV, layout_signature, source_regions, transfer_buffers, window_tail)
from sglang.srt.managers.schedule_batch import FinishReason, Req


@dataclass
class PrefillResult:
    """What the decode side needs besides the bytes (the completion notice carries it)."""

    first_token: int
    logprob: float
    top_logprobs: Optional[list] = None  # [(logprob, id)] of the first token when the request asked for them
    generator_state: Optional[bytes] = None  # a seeded request's generator after drawing the first token
    finished: bool = False  # the first token ended the request here: no KV was sent, none is needed


@dataclass
class PrefillExport:
    """A request ready for its transfer (or one that failed before its first token: `error`)."""

    room: int
    rid: str
    regions: list = field(default_factory=list)  # source Regions over PrefillSide.buffers()
    result: Optional[PrefillResult] = None
    error: Optional[str] = None


def request_kv(pool, allocator, req: Req, with_draft: bool) -> RequestKV:
    """A running request's RequestKV: its pages and the window slots of its last positions (read from the window
    map, which also reaches a tail the prefix cache holds for it)."""
    n, ps = req.num_computed, allocator.page_size
    tail = window_tail(pool.config.sliding_window, n)
    full = torch.tensor([req.alloc.pages[p // ps] * ps + p % ps for p in range(n - tail, n)], dtype=torch.int64)
    slots = allocator.full_to_swa[full.to(allocator.device)].tolist() if tail else []
    if any(s < 0 for s in slots):
        raise RuntimeError(f"request {req.rid}: a window position of its last {tail} has no window slot")
    return RequestKV(req.alloc.req_pool_idx, n, tuple(req.alloc.pages[:-(-n // ps)]), tuple(slots),
                     draft=with_draft, draft_probs=with_draft and not req.sampling_params.is_greedy)


class PrefillSide:
    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.pool = scheduler.runner.token_to_kv_pool
        self.draft = DraftStateBuffers.for_runner(scheduler.runner) if scheduler.worker.speculative else None
        self.rooms: dict = {}  # rid -> room of registered requests not exported yet
        self.held: dict = {}  # room -> Req whose slots wait for the end of its transfer
        self.exports: list = []
        self.finished: list = []  # requests a transfer's end finished: returned by the next step
        self.bytes_exported = 0
        scheduler.disagg = self

    def buffers(self) -> list:
        """Every buffer a transfer may read (register them once with the transfer engine)."""
        return transfer_buffers(self.pool, self.draft)

    def layout(self) -> tuple:
        return layout_signature(self.pool, self.draft)

    # ---- requests ----------------------------------------------------------------------------------------------
    def add_request(self, req: Req, room: int) -> None:
        """Queue a request whose state goes to the decode server waiting on `room`; ValueError when the room is in
        use or the request can never be served (nothing queued)."""
        if room in self.held or room in self.rooms.values():
            raise ValueError(f"bootstrap_room {room} is already in use on this prefill server")
        self.scheduler.add_request(req)
        self.rooms[req.rid] = room

    def pop_exports(self) -> list:
        exports, self.exports = self.exports, []
        return exports

    def finish_transfer(self, room: int, error: Optional[str] = None) -> Req:
        """The transfer of `room` ended (`error`: how it failed): free the request's slots and finish it."""
        req = self.held.pop(room, None)
        if req is None:
            raise ValueError(f"bootstrap_room {room} has no transfer in progress on this prefill server")
        if error is None:
            req.finished_reason = FinishReason("length", length=len(req.output_ids),
                                               message="prefilled; the decode server continues it")
            self.scheduler.free_request(req)  # cached like a finished request's prompt
        else:
            self.scheduler.fail_request(req, f"KV transfer to the decode server failed: {error}")
        self.finished.append(req)
        return req

    # ---- Scheduler hooks ---------------------------------------------------------------------------------------
    def after_step(self, updated: list) -> list:
        """Export the registered requests that got their first token (or failed) in this step; returns the step's
        requests plus those finished by a transfer's end since the last step."""
        for req in updated:
            room = self.rooms.get(req.rid)
            if room is None or not (req.output_ids or req.finished):
                continue
            del self.rooms[req.rid]
            if not req.output_ids:
                message = req.finished_reason.message or "the request failed before its first token"
                self.exports.append(PrefillExport(room, req.rid, error=message))
                continue
            result = PrefillResult(req.output_ids[0], req.output_token_logprobs[0], req.output_top_logprobs[0],
                                   _generator_state(req), finished=req.finished)
            if req.finished:
                self.exports.append(PrefillExport(room, req.rid, result=result))
                continue
            self.scheduler.running.remove(req)
            self.held[room] = req
            kv = request_kv(self.pool, self.scheduler.allocator, req, self.draft is not None)
            if self.draft is not None:
                self.draft.store(req.alloc.req_pool_idx, req.spec)
            regions = source_regions(self.pool, kv, self.draft)
            self.bytes_exported += sum(r.nbytes for r in regions)
            self.exports.append(PrefillExport(room, req.rid, regions, result))
        finished, self.finished = self.finished, []
        return updated + finished

    def abort(self, rid: str) -> Optional[Req]:
        """A request held for its transfer: freed and finished as aborted. Otherwise None (the Scheduler aborts it
        as any other; a registered one is then exported with the error at the next step)."""
        if rid in self.rooms:  # still queued or prefilling: the decode side learns it from the export
            self.exports.append(PrefillExport(self.rooms.pop(rid), rid, error="request aborted on the prefill server"))
            return None
        room = next((room for room, req in self.held.items() if req.rid == rid), None)
        if room is None:
            return None
        req = self.held.pop(room)
        req.finished_reason = FinishReason("abort", message="request aborted")
        self.scheduler.free_request(req)
        self.exports.append(PrefillExport(room, rid, error="request aborted on the prefill server"))
        return req

    def has_work(self) -> bool:
        """Requests to return from a step; a held request needs no step (its transfer runs beside the loop)."""
        return bool(self.finished)

    def grammar_ready(self, ready: list) -> list:
        return ready

    def grammar_refused(self, req: Req) -> None:
        """Nothing held yet; the room's export says why."""
        room = self.rooms.pop(req.rid, None)
        if room is not None:
            self.exports.append(PrefillExport(room, req.rid, error=req.finished_reason.message))


def _generator_state(req: Req) -> Optional[bytes]:
    return None if req.generator is None else bytes(req.generator.get_state().tolist())
