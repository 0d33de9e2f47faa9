"""Copies between the prefix cache's tiers, behind the scheduler (mem_cache/host_tier.py).

A copy (a write of device rows to the host tier, a load of host rows back, the restore of a loaded CSA state) is
submitted, runs in order after every copy submitted before it, and completes later; the scheduler polls for
completions every step. What it reads or writes is guarded, not waited for:
- a request's forward (and the restore of its CSA state) waits for the loads it reads (`wait_device`): on CUDA its
  stream waits for the load's event, the host does not;
- a page, window slot, state slot or host slot freed while copies are in flight goes back to its pool only once they
  have completed (`release`): a copy still reading it, or a load still to land in it, cannot meet the next owner's
  rows. Until then it counts as available (`held`), and an allocation that needs it now waits (`drain`).

TierCopyEngine is the bookkeeping (tickets, completions in submission order, held frees); CudaCopyEngine runs the
copies on a side stream with events, CpuCopyEngine (no second stream to overlap on) runs each copy at the next poll,
so the same ordering rules hold, and are tested, on CPU.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(eq=False)
class CopyTicket:
    """One submitted copy: done once it has run to the end and its host-side finish has run."""

    seq: int
    copy: Optional[Callable] = None  # the copy itself (returns its host-side finish or None), until it runs
    event: Optional[object] = None  # CUDA: recorded on the copy stream after the copy
    finish: Optional[Callable] = None  # host work once the copy completed (a pinned staging buffer's scatter)
    releases: list = field(default_factory=list)  # (pool, ids) freed while it was the last copy in flight
    done: bool = False


class TierCopyEngine:
    """Tickets in submission order and the frees they hold back. Subclasses say how a copy runs and completes."""

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self.in_flight: deque = deque()  # tickets not yet completed, oldest first
        self._held: dict = {}  # id(pool) -> ids held back

    # ---- copies -------------------------------------------------------------------------------
    def submit(self, copy: Callable[[], Optional[Callable]]) -> CopyTicket:
        """Queue `copy` after every copy before it; it returns a host-side finish (or None), run once it completed."""
        ticket = CopyTicket(next(self._seq), copy)
        self._start(ticket)
        self.in_flight.append(ticket)
        return ticket

    def poll(self) -> None:
        """Complete the copies that have finished, oldest first (a copy completes after every copy before it)."""
        while self.in_flight and self._finished(self.in_flight[0]):
            self._complete(self.in_flight.popleft())

    def wait(self, ticket: Optional[CopyTicket]) -> None:
        """The host waits for `ticket` (and so every copy before it) and completes them."""
        while ticket is not None and not ticket.done:
            self._complete(self.in_flight.popleft(), block=True)

    def wait_device(self, ticket: Optional[CopyTicket]) -> None:
        """What runs on the device from now on runs after `ticket`'s copy."""
        self.wait(ticket)

    def drain(self) -> None:
        """The host waits for every copy in flight."""
        if self.in_flight:
            self.wait(self.in_flight[-1])

    def busy(self) -> bool:
        return bool(self.in_flight)

    @staticmethod
    def latest(tickets) -> Optional[CopyTicket]:
        """The last submitted of the tickets not yet done (waiting for it waits for all of them)."""
        live = [t for t in tickets if t is not None and not t.done]
        return max(live, key=lambda t: t.seq) if live else None

    # ---- held frees ---------------------------------------------------------------------------
    def release(self, pool, ids: list) -> None:
        """pool.free(ids) now, or once every copy in flight has completed (one of them may read or fill them)."""
        if not self.in_flight:
            pool.free(ids)
            return
        self.in_flight[-1].releases.append((pool, list(ids)))
        self._held[id(pool)] = self._held.get(id(pool), 0) + len(ids)

    def held(self, pool) -> int:
        """Ids of `pool` freed and held back until the copies in flight complete."""
        return self._held.get(id(pool), 0)

    # ---- completion ---------------------------------------------------------------------------
    def _complete(self, ticket: CopyTicket, block: bool = False) -> None:
        if block:
            self._block(ticket)
        if ticket.finish is not None:
            ticket.finish()
        for pool, ids in ticket.releases:
            self._held[id(pool)] -= len(ids)
            pool.free(ids)
        ticket.releases, ticket.finish, ticket.done = [], None, True

    def _start(self, ticket: CopyTicket) -> None:
        raise NotImplementedError

    def _finished(self, ticket: CopyTicket) -> bool:
        raise NotImplementedError

    def _block(self, ticket: CopyTicket) -> None:
        raise NotImplementedError


class CpuCopyEngine(TierCopyEngine):
    """No second stream on CPU: a copy runs when it is polled or waited for, in submission order (every copy before
    it has run by then), so until then its source may not be reused nor its destination read."""

    def _start(self, ticket: CopyTicket) -> None:
        pass

    def _finished(self, ticket: CopyTicket) -> bool:
        self._run(ticket)
        return True

    def _block(self, ticket: CopyTicket) -> None:
        self._run(ticket)

    @staticmethod
    def _run(ticket: CopyTicket) -> None:
        if ticket.copy is not None:
            ticket.finish, ticket.copy = ticket.copy(), None


class CudaCopyEngine(TierCopyEngine):
    """Copies on one side stream, after what the compute stream had queued when they were submitted (the rows a
    write reads were computed by then); an event after each says when it is done, queried by `poll`. A forward that
    reads a load makes its stream wait for the event, so the host never waits for a load."""

    def __init__(self, device) -> None:
        super().__init__()
        self.stream = torch.cuda.Stream(device=device)

    def _start(self, ticket: CopyTicket) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            ticket.finish, ticket.copy = ticket.copy(), None
            ticket.event = torch.cuda.Event()
            ticket.event.record(self.stream)

    def _finished(self, ticket: CopyTicket) -> bool:
        return ticket.event.query()

    def _block(self, ticket: CopyTicket) -> None:
        ticket.event.synchronize()

    def wait_device(self, ticket: Optional[CopyTicket]) -> None:
        if ticket is not None and not ticket.done:
            torch.cuda.current_stream(self.stream.device).wait_event(ticket.event)


def make_copy_engine(device) -> TierCopyEngine:
    device = torch.device(device)
    return CudaCopyEngine(device) if device.type == "cuda" else CpuCopyEngine()


class TierCopies:
    """The token allocator's side of the copies (DeepSeekV4TokenAllocator mixes it in; `host_tier` is its host tier
    or None): the prefix cache's frees held back while copies are in flight, and requests that wait for loads."""

    host_tier = None

    def _free(self, pool, ids: list) -> None:
        """Free the prefix cache's slots; with the host tier, held back until the copies in flight complete."""
        if self.host_tier is not None:
            self.host_tier.copies.release(pool, ids)
        else:
            pool.free(ids)

    def _held(self, pool) -> int:
        return self.host_tier.copies.held(pool) if self.host_tier is not None else 0

    def _drain(self) -> None:
        if self.host_tier is not None:
            self.host_tier.copies.drain()

    def poll_copies(self) -> None:
        """Complete the copies that have landed (their held slots go back)."""
        if self.host_tier is not None:
            self.host_tier.copies.poll()

    def copies_in_flight(self) -> bool:
        return self.host_tier is not None and self.host_tier.copies.busy()

    def read_after_loads(self, alloc, node, restore: Optional[Callable] = None) -> None:
        """The request `alloc` reads node's path (and `restore`s its CSA state from node's end): when loads into it are
        in flight, both wait for them (await_loads, before its next forward); else `restore` runs now."""
        ticket = self.host_tier.pending_load(node) if self.host_tier is not None else None
        if ticket is None:
            if restore is not None:
                restore()
            return
        alloc.pending = TierCopyEngine.latest([alloc.pending, ticket])
        if restore is not None:
            alloc.on_ready = restore

    def await_loads(self, allocs: list) -> None:
        """Before a forward of these requests: what runs on the device from now on waits for the loads they read (on
        CUDA the stream waits, not the host), then their CSA states are restored."""
        for alloc in allocs:
            if alloc.pending is not None:
                self.host_tier.copies.wait_device(alloc.pending)
                alloc.pending = None
            if alloc.on_ready is not None:
                alloc.on_ready()
                alloc.on_ready = None
