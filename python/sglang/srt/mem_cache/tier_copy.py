"""Copies between the prefix cache's tiers, behind the scheduler (mem_cache/host_tier.py).

A copy (a write of device rows to the host tier, a load of host rows back) is submitted in stages, runs in order
after every copy submitted before it, and completes later; the scheduler polls for completions every step. What it
reads or writes is guarded, not waited for:
- a load's stages are what must land before a request's prefill starts (its CSA state rows, restored into the
  request's own, and the MTP layers' window rows), then each layer's rows in layer order: the forward waits for
  stage 0, then before each layer for that layer's stage (`wait_device`), so the load of later layers overlaps the
  compute of earlier ones; on CUDA the compute stream waits for the stage's event, the host does not;
- a page, window slot, state slot or host slot freed while copies are in flight goes back to its pool only once they
  have completed (`release`): a copy still reading it, or a load still to land in it, cannot meet the next owner's
  rows. Until then it counts as available (`held`), and an allocation that needs it now waits (`drain`).

TierCopyEngine is the bookkeeping (tickets, completions in submission order, held frees); CudaCopyEngine runs the
copies on a side stream with an event after each stage, CpuCopyEngine (no second stream to overlap on) runs a stage
when it is waited for or polled, so the same ordering rules hold, and are tested, on CPU.
"""

from __future__ import annotations

import abc
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(eq=False)
class CopyTicket:
    """One submitted copy: `landed` of its stages have run (CPU) or been queued (CUDA); done once every stage has
    completed and its host-side finishes have run."""

    seq: int
    stages: list  # callables, each returning its host-side finish or None
    landed: int = 0
    events: list = field(default_factory=list)  # CUDA: one per stage, recorded on the copy stream after it
    finishes: list = field(default_factory=list)  # host work once the copy completed (a staging buffer's scatter)
    releases: list = field(default_factory=list)  # (pool, ids) freed while it was the last copy in flight
    done: bool = False


class TierCopyEngine(abc.ABC):
    """Tickets in submission order and the frees they hold back. Subclasses say how a stage runs and completes."""

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self.in_flight: deque = deque()  # tickets not yet completed, oldest first
        self._held: dict = {}  # id(pool) -> ids held back

    # ---- copies -------------------------------------------------------------------------------
    def submit(self, *stages: Callable[[], Optional[Callable]]) -> CopyTicket:
        """Queue the stages after every copy before them; each returns a host-side finish (or None), run once the
        copy has completed."""
        ticket = CopyTicket(next(self._seq), list(stages))
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

    def wait_device(self, ticket: Optional[CopyTicket], stage: Optional[int] = None) -> None:
        """What runs on the device from now on runs after `ticket`'s stages up to `stage` (None: all of them)."""
        if ticket is None or ticket.done:
            return
        if stage is None or stage >= len(ticket.stages) - 1:
            self.wait(ticket)
            return
        while self.in_flight[0] is not ticket:  # on CPU a stage runs after every copy before it
            self._complete(self.in_flight.popleft(), block=True)
        self._run(ticket, stage + 1)

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

    # ---- stages and completion ----------------------------------------------------------------
    @staticmethod
    def _run(ticket: CopyTicket, upto: int) -> None:
        """Run the ticket's stages before `upto` that have not run."""
        while ticket.landed < upto:
            finish = ticket.stages[ticket.landed]()
            ticket.landed += 1
            if finish is not None:
                ticket.finishes.append(finish)

    def _complete(self, ticket: CopyTicket, block: bool = False) -> None:
        if block:
            self._block(ticket)
        for finish in ticket.finishes:
            finish()
        for pool, ids in ticket.releases:
            self._held[id(pool)] -= len(ids)
            pool.free(ids)
        ticket.releases, ticket.finishes, ticket.stages, ticket.done = [], [], [], True

    @abc.abstractmethod
    def _start(self, ticket: CopyTicket) -> None:
        """Queue the ticket's stages (CUDA: on the copy stream; CPU: nothing runs until it is waited for or polled)."""

    @abc.abstractmethod
    def _finished(self, ticket: CopyTicket) -> bool:
        """Whether every stage of the ticket has completed, without waiting."""

    @abc.abstractmethod
    def _block(self, ticket: CopyTicket) -> None:
        """Wait on the host until the ticket's stages have completed."""


class CpuCopyEngine(TierCopyEngine):
    """No second stream on CPU: a stage runs when it is waited for or the copy is polled, in submission order (every
    copy before it has run by then), so until then its source may not be reused nor its destination read."""

    def _start(self, ticket: CopyTicket) -> None:
        pass

    def _finished(self, ticket: CopyTicket) -> bool:
        self._run(ticket, len(ticket.stages))
        return True

    def _block(self, ticket: CopyTicket) -> None:
        self._run(ticket, len(ticket.stages))


class CudaCopyEngine(TierCopyEngine):
    """Copies on one side stream, after what the compute stream had queued when they were submitted (the rows a
    write reads were computed by then); an event after each stage, the last one queried by `poll`. A forward that
    reads a load makes its stream wait for the stages it needs, so the host never waits for a load."""

    def __init__(self, device) -> None:
        super().__init__()
        self.stream = torch.cuda.Stream(device=device)

    def _start(self, ticket: CopyTicket) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for _ in ticket.stages:
                self._run(ticket, ticket.landed + 1)
                ticket.events.append(torch.cuda.Event())
                ticket.events[-1].record(self.stream)

    def _finished(self, ticket: CopyTicket) -> bool:
        return ticket.events[-1].query()

    def _block(self, ticket: CopyTicket) -> None:
        ticket.events[-1].synchronize()

    def wait_device(self, ticket: Optional[CopyTicket], stage: Optional[int] = None) -> None:
        if ticket is not None and not ticket.done:
            event = ticket.events[-1 if stage is None else min(stage, len(ticket.events) - 1)]
            torch.cuda.current_stream(self.stream.device).wait_event(event)


def make_copy_engine(device) -> TierCopyEngine:
    device = torch.device(device)
    return CudaCopyEngine(device) if device.type == "cuda" else CpuCopyEngine()


class TierCopies:
    """The token allocator's side of the copies (DeepSeekV4TokenAllocator mixes it in; `host_tier` is its host tier
    or None): the prefix cache's frees held back while copies are in flight, requests that wait for loads, and the
    file tier's reads for waiting requests (mem_cache/file_prefetch.py)."""

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
        """Complete the copies that have landed (their held slots go back); put the file reads that finished in the
        tree."""
        if self.host_tier is not None:
            self.host_tier.copies.poll()
            if self.prefetcher is not None:
                self.prefetcher.poll(self.cache)

    def copies_in_flight(self) -> bool:
        """Copies still to land, or file reads of aborted requests whose slots go back once the reader stops."""
        prefetcher = self.prefetcher
        return self.host_tier is not None and (self.host_tier.copies.busy()
                                               or (prefetcher is not None and bool(prefetcher.draining)))

    # ---- the file tier's reads while requests wait (mem_cache/file_prefetch.py) -------------------------
    @property
    def prefetcher(self):
        files = self.host_tier.files if self.host_tier is not None else None
        return files.prefetcher if files is not None else None

    def start_prefetch(self, tokens: list, limit: int):
        """A request was queued: its FilePrefetch, hashing its tokens behind the scheduler, then reading (or sharing
        another waiting request's reads of) the prefix the file tier holds past the tree; None when there is none."""
        return self.prefetcher.start(self.cache, tokens, limit) if self.prefetcher is not None else None

    def advance_prefetch(self, prefetch) -> None:
        """A waiting request's reads planned once its tokens are hashed (and again past a shared read that landed)."""
        self.prefetcher.advance(self.cache, prefetch)

    def prefetch_waits(self, prefetch) -> bool:
        """Whether the prefetch policy keeps a waiting request out of admission for its reads."""
        return prefetch is not None and self.prefetcher.waits(prefetch)

    def drop_prefetch(self, prefetch) -> None:
        """A request admitted (after its match) or aborted: its reads still to come cancelled, their slots freed."""
        if prefetch is not None:
            self.prefetcher.drop(self.cache, prefetch)

    def settle_reads(self) -> None:
        """Wait for the reader to stop on the reads of requests that left while being read, and free their slots."""
        prefetcher = self.prefetcher
        while prefetcher is not None and prefetcher.draining:
            prefetcher.wait(0.01)
            prefetcher.poll(self.cache)

    def wait_for_reads(self) -> None:
        """Nothing to run: sleep until a file read or a prompt's hashing stops (briefly), rather than spin while
        requests wait for them."""
        if self.prefetcher is not None and self.prefetcher.pending():
            self.prefetcher.wait(0.005)

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

    def await_loads(self, allocs: list, layered: bool) -> None:
        """Before a forward of these requests: what runs on the device from now on waits for the loads they read (on
        CUDA the stream waits, not the host), then their CSA states are restored from them. `layered` (a forward that
        calls ForwardBatch.before_layer): only for the first stage, the layers' rows are waited for layer by layer
        (layer_waits)."""
        for alloc in allocs:
            if alloc.pending is not None and alloc.pending.done:
                alloc.pending = None
            if alloc.pending is not None:
                self.host_tier.copies.wait_device(alloc.pending, 0 if layered else None)
            if alloc.on_ready is not None:
                alloc.on_ready()
                alloc.on_ready = None

    def layer_waits(self, allocs: list) -> Optional[Callable[[int], None]]:
        """ForwardBatch.before_layer of a forward of these requests (after await_loads): the device waits for layer
        i's rows of the loads they read before layer i runs, so later layers' rows land while earlier layers compute
        (None when none is in flight). The last of their loads: waiting for a stage of it waits for every earlier
        copy."""
        ticket = TierCopyEngine.latest([a.pending for a in allocs])
        if ticket is None:
            return None
        copies = self.host_tier.copies
        return lambda layer: copies.wait_device(ticket, layer + 1)
