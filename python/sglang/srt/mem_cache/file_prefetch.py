"""Reading a waiting request's prefix from the file tier in the background (mem_cache/file_tier.py).

A read from the files (the disk, a CRC check, a copy into host slots) must not stall the running requests' steps, so
it happens while the request waits in the queue, not when it is admitted:
- when the request is queued, the scheduler walks the tree for it (RadixCache.walk_prefix: nothing touched); where
  the walk runs past what the device and host tiers hold (and the files hold anything), the chain hashes that name
  its files (every whole page's, and the end files' keys there) are computed on a reader thread, not on the
  scheduler's (a long prompt's take milliseconds);
- once they are, at the next step: the pages whose files follow on past the walk, up to the deepest end file among
  them (or the end file of a node on the path with no end on either tier), are planned, host slots reserved for
  them (out of the tree: no other request can take or evict them; the policy says what room may be made) and the
  node the reads hang under locked, so it stays. Where another waiting request's read (still live) is of the same
  files from the same node, up to the same end or short of this request's deepest end, the request joins it
  instead: no slots reserved, no file read twice; one that needs more looks again once that read landed, and plans
  the rest under what it grafted. One whose deepest end is one the read passes (its pages the read's first) joins
  it too, as a stop: only that end's slot reserved (once, however many requests stop there), its end file read
  with the read's;
- a reader thread reads the files into those slots, pages in order, then the stops' ends the landed pages reach,
  then the deepest end they reach past those (a missing or unusable file stops the pages: a CRC failure is a miss,
  as for any file read, for every request waiting on the read); the scheduler keeps stepping;
- each step the scheduler grafts what finished: a new host-only node under the locked one (or the locked node's host
  end), split at each stop that landed (so a stopping request's match ends there), the deepest held locked until
  the last request waiting on the read is admitted; each matches and loads it as any host hit. Where the tree took
  that continuation meanwhile (another request computed it), the read is dropped;
- --hicache-storage-prefetch-policy says when a waiting request is admitted: best_effort whenever the scheduler would
  anyway, with what has landed; wait_complete once its reads landed; timeout as wait_complete, but no longer than
  `prefetch_timeout_base` seconds after it was queued (the reader stops there too, at its latest waiter's). A request
  admitted before its reads landed, or aborted, stops waiting on them; reads no other request waits on are
  cancelled: the slots of reads not started are freed at once, those of a read in progress once the reader is done
  with them (the next step's poll), so host-tier accounting comes back to where it was. A stop no request waits at
  any more is dropped (its slot freed) unless the reader already took it: its end then lands as a cached end.
The reader is replaceable (`FilePrefetcher.reader`): a test can hold reads back and release them, as the CPU copy
engine lands copies only when polled; so is where the hashing runs (`FilePrefetcher.hasher`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

from sglang.srt.mem_cache.radix_cache import TreeNode

logger = logging.getLogger(__name__)

_READER_THREADS = 2  # reads of different requests overlap; one request's are in order


class ThreadedReader:
    """Runs prefetch reads on a small pool of threads."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(_READER_THREADS, thread_name_prefix="hicache-file-reader")

    def submit(self, job: Callable[[], None]) -> None:
        self._pool.submit(job)


@dataclass(eq=False)
class PromptKeys:
    """What names a waiting request's files: the chain hash after each whole page of its tokens and, per page, the keys
    of an end file there. Computed on a reader thread (FileTier.prompt_keys), not on the scheduler's."""

    tokens: list
    pages: list = field(default_factory=list)
    ends: list = field(default_factory=list)  # per page: (key without a next token, key with the next one or None, it)
    done: bool = False

    def end_file(self, i: int, store) -> Optional[tuple]:
        """(key, next token) of an end file after page i that the request can use, or None."""
        plain, with_next, next_token = self.ends[i]
        if plain in store:
            return plain, None
        if with_next is not None and with_next in store:
            return with_next, next_token
        return None


@dataclass(eq=False)
class ReadStop:
    """An end inside a read's pages that requests joining the read stop at: its file is read into its own slot and
    the graft splits the read's node there."""

    pages: int  # pages of the read's key before it
    file: tuple  # (end file key, next token)
    slot: int  # host end slot reserved
    waiters: int = 1
    landed: bool = False  # its end file is in `slot` (the reader's)
    node: Optional[TreeNode] = None  # the grafted node ending there


@dataclass(eq=False)
class FileRead:
    """The reads of one run of files into host slots. `parent`: the node they hang under (locked until the last
    request waiting on them is admitted or dropped); `key` its continuation's tokens (empty: only `parent`'s end is
    read); `waiters`: the waiting requests that wait on it (the one that planned it and those that joined it, stops
    included)."""

    parent: TreeNode
    key: list  # whole pages, up to the deepest end planned
    hashes: list  # the chain hash of each page of key
    slots: list  # host page slots reserved, one per hash
    ends: list  # (pages of key before it, (end file key, next token)), deepest last
    end_slot: int  # host end slot reserved
    started: float  # the first waiting request's queueing
    deadline: float  # the timeout policy's (the latest of its waiters'); inf otherwise
    waiters: int = 1
    state: str = "queued"  # queued -> reading -> read -> landed; cancelled (from queued or reading)
    pages_read: int = 0  # pages of key whose file landed in their slot (the reader's)
    end_read: Optional[tuple] = None  # (pages, next token) of the end that landed in end_slot
    bytes_read: int = 0
    finished: Optional[float] = None  # when the reader stopped
    node: Optional[TreeNode] = None  # what landed, grafted and locked (its waiters match it at admission)
    reserved: list = field(default_factory=list)  # (allocator, ids) still held by this read
    stops: list = field(default_factory=list)  # ReadStop, of requests whose deepest end the read passes
    sealed: bool = False  # the reader took the stops to read: no stop is added or dropped any more

    @property
    def landed(self) -> bool:
        """The reads are over and what they read is in the tree (or was dropped)."""
        return self.state == "landed"


@dataclass(eq=False)
class FilePrefetch:
    """One waiting request's side: its keys (hashed behind the scheduler), then the read it waits on: its own, or
    another waiting request's read of the same files that it joined."""

    tokens: list
    limit: int
    keys: PromptKeys
    started: float
    deadline: float  # the timeout policy's; inf otherwise
    read: Optional[FileRead] = None
    stop: Optional[ReadStop] = None  # where it stops inside the read it joined (None: at the read's deepest end)
    planned: bool = False  # its files were looked for (once its keys were computed)
    more: bool = False  # its files go on past the read it joined: looked for again once that one landed

    @property
    def node(self) -> Optional[TreeNode]:
        """What its reads grafted (the request's match there is a file hit)."""
        if self.read is None or self.read.node is None:
            return None
        return self.stop.node if self.stop is not None else self.read.node

    @property
    def landed(self) -> bool:
        return self.planned and not self.more and (self.read is None or self.read.landed)


class FilePrefetcher:
    """The file tier's reads for waiting requests (see the module docstring). Everything but the hashing and the reads
    themselves runs on the scheduler's thread."""

    def __init__(self, files) -> None:
        self.files = files
        self.reader = ThreadedReader()
        self.hasher = self.reader  # where a waiting request's keys are computed (a test may run them inline)
        self.clock = time.monotonic
        self.live: list = []  # reads not yet landed nor dropped
        self.draining: list = []  # cancelled while being read: freed once the reader stops
        self.hashing = 0  # requests' keys being computed
        self._lock = threading.Lock()
        self._stopped = threading.Event()  # a read or a hashing stopped since the last poll

    # ---- start (scheduler thread) ---------------------------------------------------------------------
    def start(self, cache, tokens: list, limit: int) -> Optional[FilePrefetch]:
        """A request was queued: None when the files cannot hold anything of its prefix past the tree's match; else
        its prefetch, its keys computed on a reader thread, its reads planned once they are (`advance`)."""
        if not self.files.store.index:
            return None
        best, walk = cache.walk_prefix(tokens, limit)
        past_tree = walk.node is not None and walk.pos < walk.limit
        if not past_tree and (walk.file_end is None or walk.file_end[0] <= best.num_tokens):
            return None
        now = self.clock()
        p = FilePrefetch(tokens, limit, PromptKeys(tokens), now, now + self.files.timeout())
        with self._lock:
            self.hashing += 1
        self.hasher.submit(lambda: self._hash(p.keys))
        self.advance(cache, p)
        return p

    def advance(self, cache, p: FilePrefetch) -> None:
        """Plan p's reads once its keys are computed; look again past the read it joined once that one landed, when
        its files go on further (not when it landed short: that is a miss for every request waiting on it)."""
        if not p.planned:
            if p.keys.done:
                p.planned = True
                p.read = self._open(cache, p)
            return
        if p.more and p.read.landed:
            p.more = False
            old = p.read
            if old.node is None or old.end_read is None or old.end_read[0] < old.ends[-1][0]:
                return
            new = self._open(cache, p)  # under the node that landed, locked until the old read is left
            if new is not None:
                p.read = new
                self._leave(cache, old)

    def _open(self, cache, p: FilePrefetch) -> Optional[FileRead]:
        """Plan the reads of p's prefix the files hold past the tree, when they reach deeper than the tree's own
        match: join a live read of the same files, else reserve and queue them; None when there is nothing to read
        or no room for it."""
        files, tier, ps, keys = self.files, cache.tier, self.files.page_size, p.keys
        best, walk = cache.walk_prefix(p.tokens, p.limit)
        plan = None
        if walk.node is not None and walk.pos < walk.limit:
            first = walk.pos // ps
            hashes = keys.pages[first:walk.limit // ps]
            run = 0
            while run < len(hashes) and hashes[run] in files.store:
                run += 1
            ends = [(j, f) for j in range(1, run + 1) if (f := keys.end_file(first + j - 1, files.store)) is not None]
            if ends and walk.pos + ends[-1][0] * ps > best.num_tokens:
                plan = (walk.node, walk.pos, hashes, ends)
        if plan is None and walk.file_end is not None and walk.file_end[0] > best.num_tokens:
            pos, node, found = walk.file_end
            plan = (node, pos, [], [(0, found)])
        if plan is None:
            return None
        parent, pos, hashes, ends = plan
        joined = self._join(tier, p, parent, hashes, ends)
        if joined is not None:
            return joined
        cache.lock(parent)  # the path stays while the host makes room, and until its waiters are admitted
        reserved = self._reserve(tier, ends)
        if reserved is None:
            cache.unlock(parent)
            return None
        slots, end_slot, ends = reserved
        read = FileRead(parent, list(p.tokens[pos:pos + len(slots) * ps]), hashes[:len(slots)], slots, ends,
                        end_slot, p.started, p.deadline)
        read.reserved = [(tier.pages, list(slots)), (tier.ends, [end_slot])]
        self.live.append(read)
        self.reader.submit(lambda: self._read(read))
        return read

    def _join(self, tier, p: FilePrefetch, parent, hashes: list, ends: list) -> Optional[FileRead]:
        """A live read from the same node whose pages are the first of p's, ending at p's deepest end or short of it
        (p looks for the rest once it landed), or passing p's deepest end (p stops there): p waits on it rather than
        read the same files again."""
        deepest = ends[-1]
        for read in self.live:
            if read.parent is not parent:
                continue
            n, j = len(read.hashes), deepest[0]
            if hashes[:n] == read.hashes and (deepest == read.ends[-1] or (n and j > n)):
                p.more = j > n
            elif not (0 < j < n and hashes[:j] == read.hashes[:j] and deepest in read.ends):
                continue
            elif (stop := self._stop(tier, read, deepest)) is not None:
                p.stop = stop
            else:  # no stop there for p (see _stop): p reads its own
                continue
            read.waiters += 1
            read.deadline = max(read.deadline, p.deadline)
            return read
        return None

    def _stop(self, tier, read: FileRead, end: tuple) -> Optional[ReadStop]:
        """The read's stop at `end` (its slot reserved when it is new), or None when the reader took the stops
        already, the host has no room for the end, or another end is read there (a node has one end)."""
        for stop in read.stops:
            if stop.pages == end[0]:
                if stop.file != end[1]:
                    return None
                stop.waiters += 1  # read with the others, or already taken by the reader: lands (or not) for all
                return stop
        if read.sealed or not self.files.room(tier, 0, 1):
            return None
        slot = tier.ends.alloc(1)[0]
        stop = ReadStop(end[0], end[1], slot)
        with self._lock:
            if not read.sealed:
                read.stops.append(stop)
                read.reserved.append((tier.ends, [slot]))
                return stop
        tier.ends.free([slot])
        return None

    def _reserve(self, tier, ends: list) -> Optional[tuple]:
        """(page slots, end slot, the ends they reach) for the deepest end the host makes room for, or None."""
        if not self.files.room(tier, 0, 1):
            return None
        end_slot = tier.ends.alloc(1)[0]
        need = ends[-1][0]
        if need and not self.files.room(tier, need, 0):
            ends = [e for e in ends if e[0] <= tier.pages.available()]
            if not ends:
                tier.ends.free([end_slot])
                return None
            need = ends[-1][0]
        return tier.pages.alloc(need) if need else [], end_slot, ends

    # ---- hashing and reads (reader thread) ---------------------------------------------------------------
    def _hash(self, keys: PromptKeys) -> None:
        try:
            keys.pages, keys.ends = self.files.prompt_keys(keys.tokens)
        except Exception:  # no keys: nothing of the files is read for it
            logger.exception("file tier: hashing a prompt failed")
        finally:
            with self._lock:
                keys.done = True
                self.hashing -= 1
            self._stopped.set()

    def _read(self, p: FileRead) -> None:
        with self._lock:
            if p.state != "queued":
                return
            p.state = "reading"
        store, pool = self.files.store, self.files.pool
        try:
            for h, slot in zip(p.hashes, p.slots):
                if p.state != "reading" or self.clock() > p.deadline:
                    break
                payload = store.get(h)
                if payload is None or len(payload) != pool.page_nbytes:
                    break
                pool.set_page_payload(slot, payload)
                p.bytes_read += len(payload)
                p.pages_read += 1
            with self._lock:
                p.sealed = True
                stops = sorted((s for s in p.stops if s.pages <= p.pages_read), key=lambda s: s.pages)
            for s in stops:
                if p.state != "reading":
                    break
                payload = store.get(s.file[0])
                if payload is not None and len(payload) == pool.end_nbytes:
                    pool.set_end_payload(s.slot, payload)
                    p.bytes_read += len(payload)
                    s.landed = True
            below = max((s.pages for s in stops if s.landed), default=0)  # a stop's end there: no need to go lower
            for j, found in reversed([e for e in p.ends if below < e[0] <= p.pages_read]):
                if p.state != "reading":
                    break
                payload = store.get(found[0])
                if payload is not None and len(payload) == pool.end_nbytes:
                    pool.set_end_payload(p.end_slot, payload)
                    p.bytes_read += len(payload)
                    p.end_read = (j, found[1])
                    break
        except Exception:  # what landed before it stays usable; the rest is a miss
            logger.exception("file tier: a prefetch read failed")
        finally:
            with self._lock:
                p.sealed = True  # a read that raised before its stops never reads them
                p.finished = self.clock()
                if p.state == "reading":
                    p.state = "read"
            self._stopped.set()

    # ---- landing and dropping (scheduler thread) -----------------------------------------------------
    def poll(self, cache) -> None:
        """Graft the reads that finished; free the slots of cancelled ones the reader is done with."""
        self._stopped.clear()
        with self._lock:
            done = [p for p in self.live if p.state == "read"]
            freed = [p for p in self.draining if p.finished is not None]
        for p in done:
            self.live.remove(p)
            self._graft(cache, p)
        for p in freed:
            self.draining.remove(p)
            cache.tier.stats.bytes_from_file += p.bytes_read
            self._free(p)

    def _graft(self, cache, p: FileRead) -> None:
        """Put what landed in the tree as a host copy (locked for its waiters), one node per end that landed, unless
        the tree took it meanwhile."""
        stats, ps = cache.tier.stats, self.files.page_size
        stats.bytes_from_file += p.bytes_read
        stats.file_read_seconds.append(p.finished - p.started)
        p.state = "landed"
        ends = sorted(((s.pages, s.slot, s.file[1], s) for s in p.stops if s.landed), key=lambda e: e[0])
        if p.end_read is not None:
            ends.append((p.end_read[0], p.end_slot, p.end_read[1], None))
        if not ends:
            self._free(p)
            return
        parent = p.parent
        if not p.key:  # the end of a node on the path (a read of no pages has no stops)
            next_token = p.end_read[1]
            if parent.host_end is None and not parent.usable:
                parent.host_end, parent.host_next_token = p.end_slot, next_token
                p.reserved = []
                p.node = parent
            self._free(p)
            return
        first = tuple(p.key[:ps])
        if first in parent.children:  # the tree holds this continuation now (computed meanwhile)
            self._free(p)
            return
        node, start, now = parent, 0, next(cache._clock)
        for j, slot, next_token, stop in ends:
            child = TreeNode(node, p.key[start * ps:j * ps], [], last_access=now, host_pages=p.slots[start:j],
                             host_end=slot, host_next_token=next_token, page_hashes=p.hashes[start:j])
            node.children[tuple(child.key[:ps])] = child
            node, start = child, j
            if stop is not None:
                stop.node = child
        in_tree = {slot for _, slot, _, _ in ends}
        unused = [slot for slot in [p.end_slot] + [s.slot for s in p.stops] if slot not in in_tree]
        p.reserved = [(cache.tier.pages, p.slots[start:]), (cache.tier.ends, unused)]
        self._free(p)
        cache.lock(node)  # before the parent's unlock: the shared path stays locked throughout
        cache.unlock(parent)
        p.node = node

    def waits(self, p: Optional[FilePrefetch]) -> bool:
        """Whether the policy keeps the request waiting for its reads."""
        if p is None or p.landed:
            return False
        policy = self.files.prefetch_policy
        return policy == "wait_complete" or (policy == "timeout" and self.clock() <= p.deadline)

    def drop(self, cache, p: Optional[FilePrefetch]) -> None:
        """The request was admitted (after matching what landed) or aborted: it stops waiting on its read, which is
        cancelled when no other request waits on it."""
        if p is None:
            return
        read, p.read = p.read, None
        stop, p.stop = p.stop, None
        if stop is not None:
            self._leave_stop(cache, read, stop)
        if read is not None:
            self._leave(cache, read)

    def _leave_stop(self, cache, r: FileRead, stop: ReadStop) -> None:
        """One request less stopping there; with none left, the end is not read (unless the reader took it)."""
        with self._lock:
            stop.waiters -= 1
            if stop.waiters or r.sealed:
                return
            r.stops.remove(stop)
            r.reserved.remove((cache.tier.ends, [stop.slot]))
        cache.tier.ends.free([stop.slot])

    def _leave(self, cache, r: FileRead) -> None:
        """One waiter less; with none left, cancel the reads still to come, free the slots not in the tree, unlock."""
        r.waiters -= 1
        if r.waiters:
            return
        with self._lock:
            state = r.state
            if state in ("queued", "reading"):
                r.state = "cancelled"
        if state in ("queued", "reading", "read"):
            self.live.remove(r)
        if state == "reading":  # the reader may be filling one of the slots: freed once it stops
            self.draining.append(r)
        elif state in ("read", "queued"):
            cache.tier.stats.bytes_from_file += r.bytes_read
            self._free(r)
        cache.unlock(r.node if r.node is not None else r.parent)
        r.node = None

    def _free(self, p: FileRead) -> None:
        for allocator, ids in p.reserved:
            if ids:
                allocator.free(ids)
        p.reserved = []

    # ---- accounting ----------------------------------------------------------------------------------
    def reserved(self, allocator) -> int:
        """Slots of `allocator` (the host tier's pages or ends) held by reads, out of the tree."""
        return sum(len(ids) for p in self.live + self.draining for a, ids in p.reserved if a is allocator)

    def busy(self) -> bool:
        return bool(self.live or self.draining)

    def pending(self) -> bool:
        """Keys being computed or reads to land: what an idle scheduler may wait for."""
        return bool(self.live or self.hashing)

    def wait(self, timeout: float) -> None:
        """Block until a read or a hashing stops (or `timeout` seconds): an idle scheduler waiting only for them
        sleeps."""
        self._stopped.wait(timeout)
