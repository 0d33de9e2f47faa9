"""The host tier of the prefix cache (--enable-hierarchical-cache): cached prefixes the device pool evicts move to
host memory (pinned on CUDA) and come back on a hit, instead of being computed again.

What a cached V4 prefix is, on either tier (mem_cache/radix_cache.py): per node its pages - every compressed layer's
entries of the page's tokens (page_size / m per ratio-m layer) and every CSA layer's indexer keys - and per usable end
its window tail (the window KV of the `window` positions before it, every layer, MTP layers included) and its CSA
staging state (every CSA compressor's saved rows). The host pool keeps rows in the device pools' own formats (FP8 /
FP4 as stored), page for page and end for end, so a move is a byte copy: nothing is re-encoded.

When a copy is made (--hicache-write-policy, upstream's names):
- write_back: when the device evicts a node (its pages, or its end under window pressure);
- write_through: when a node is cached (inserted), so eviction from the device costs nothing;
- write_through_selective: when a node has been matched twice (a prefix reused, not a one-off turn).
The host evicts least recently used copies; an end dropped without a copy is gone (its pages stay usable for deeper
ends). A match that ends at an end the host holds loads the host-only nodes of its path and the end back into free
device pages, window slots and a state slot at the request's admission (HostTier.load), all or nothing: when the
device cannot take them the match falls back to its deepest device end. The rows land behind the scheduler, layer by
layer, while the request's prefill waits for each layer's (below).

How rows move (--hicache-io-backend, upstream's names): `kernel` gathers every buffer's rows with one indexed copy,
moves them in one transfer and scatters them with one indexed copy; `direct` copies each page's contiguous rows with
its own copy (the window tail and state rows, scattered, as `kernel`). Every move runs on the copy engine
(mem_cache/tier_copy.py), behind the scheduler: the slots change hands at once, the rows land later; what reads a
load waits for it (HostTier.pending_load), what frees a slot under a copy gets it back once the copy completed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.arg_groups.cli import HICACHE_IO_BACKENDS as IO_BACKENDS
from sglang.srt.arg_groups.cli import HICACHE_WRITE_POLICIES as WRITE_POLICIES
from sglang.srt.mem_cache.allocator import PageAllocator
from sglang.srt.mem_cache.radix_cache import TreeNode
from sglang.srt.mem_cache.tier_copy import CopyTicket, make_copy_engine

logger = logging.getLogger(__name__)

_SELECTIVE_HITS = 2  # write_through_selective: matches before a node is copied to the host


@dataclass(frozen=True)
class HostTierShape:
    """Sizes chosen by pool sizing (plan_host_tier): host page slots and end slots (each excluding reserved slot 0)."""

    num_pages: int
    num_ends: int
    nbytes: int  # host memory of both


@dataclass
class HostTierStats:
    """Totals since start (and load latencies since the last `take`): what /metrics reports."""

    host_hit_tokens: int = 0  # prompt tokens of matches that loaded something from the host (or the files)
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    num_loads: int = 0
    load_seconds: list = field(default_factory=list)  # since the last take
    file_hit_tokens: int = 0  # prompt tokens of matches the file tier made deeper (mem_cache/file_tier.py)
    bytes_to_file: int = 0
    bytes_from_file: int = 0
    file_read_seconds: list = field(default_factory=list)  # queueing to file reads landed, since the last take

    def take(self) -> "HostTierStats":
        """A copy for the metrics, the latencies moved into it."""
        out = dataclasses.replace(self)
        self.load_seconds, self.file_read_seconds = [], []
        return out


def _page_rows(pages: list, rows_per_page: int) -> torch.Tensor:
    """Rows of pages in a buffer with rows_per_page rows per page, page by page."""
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * rows_per_page
            + torch.arange(rows_per_page)[None, :]).flatten()


class _Rows:
    """The row indices of one copy, built once and shared by its buffers and stages (a load's layers): the rows of a
    list of pages at a number of rows per page, or a list of rows, on the host or on the copy's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._built: dict = {}

    def pages(self, pages, rows_per_page: int, on_device: bool) -> torch.Tensor:
        return self._get(("pages", tuple(pages), rows_per_page, on_device), lambda: _page_rows(pages, rows_per_page))

    def rows(self, rows, on_device: bool) -> torch.Tensor:
        return self._get(("rows", tuple(rows), on_device), lambda: torch.tensor(rows, dtype=torch.int64))

    def _get(self, key: tuple, build) -> torch.Tensor:
        if key not in self._built:
            self._built[key] = _to(build(), self.device) if key[-1] else build()
        return self._built[key]


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on device; host -> CUDA from pinned memory, so the copy does not wait for the device."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """A contiguous run of rows as flat bytes (a view)."""
    return rows.reshape(-1).view(torch.uint8)


def _scatter_payload(targets: list, payload: bytes) -> None:
    """Copy a payload laid out as page_payload / end_payload makes it into (host buffer, slot, rows per slot)."""
    data, off = torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0
    for host, slot, n in targets:
        dst = _as_bytes(host[slot * n:(slot + 1) * n])
        dst.copy_(data[off:off + dst.numel()])
        off += dst.numel()


class HostKVPool:
    """Host buffers in the device pool's row formats: per compressed layer (and CSA layer's indexer keys) page
    slots of page_size / m rows; per end slot `window` window-KV rows of every layer and the m saved rows of every
    CSA compressor. Slot 0 is reserved in both, as in every pool."""

    def __init__(self, device_pool, shape: HostTierShape, io_backend: str) -> None:
        self.device_pool, self.io_backend = device_pool, io_backend
        self.device = torch.device(device_pool.device)
        pin = self.device.type == "cuda"
        config, ps = device_pool.config, device_pool.shape.page_size
        self.window = config.sliding_window
        self._finish = []  # host-side scatters of device -> host copies in flight (take_finish)

        def host_like(buf: torch.Tensor, rows: int) -> torch.Tensor:
            return torch.zeros((rows, *buf.shape[1:]), dtype=buf.dtype, pin_memory=pin)

        # (device buffer, host buffer, rows per page or end); the layer of each page buffer (end buffers: by index)
        self.page_buffers, self.page_layers = [], []
        for layer, buf in [*device_pool.compressed_kv.items(), *device_pool.index_k.items()]:
            epp = ps // config.compress_ratio(layer)
            self.page_buffers.append((buf, host_like(buf, (shape.num_pages + 1) * epp), epp))
            self.page_layers.append(layer)
        self.num_layers = config.num_hidden_layers  # end buffers past them are the MTP layers' window rows
        self.end_buffers = [(buf, host_like(buf, (shape.num_ends + 1) * self.window), self.window)
                            for buf in device_pool.window_kv]
        self.state_buffers = [(s.saved, host_like(s.saved, (shape.num_ends + 1) * s.ratio), s.ratio)
                              for s in device_pool.csa_states()]

    # ---- bytes of one page or end (the file tier's payloads), buffer after buffer ----------------------
    @property
    def page_nbytes(self) -> int:
        return sum(h[:n].numel() * h.element_size() for _, h, n in self.page_buffers)

    @property
    def end_nbytes(self) -> int:
        return sum(h[:n].numel() * h.element_size() for _, h, n in self.end_buffers + self.state_buffers)

    def page_payload(self, slot: int) -> bytes:
        return b"".join(_as_bytes(h[slot * n:(slot + 1) * n]).numpy().tobytes() for _, h, n in self.page_buffers)

    def end_payload(self, slot: int) -> bytes:
        return b"".join(_as_bytes(h[slot * n:(slot + 1) * n]).numpy().tobytes()
                        for _, h, n in self.end_buffers + self.state_buffers)

    def set_page_payload(self, slot: int, payload: bytes) -> None:
        _scatter_payload([(h, slot, n) for _, h, n in self.page_buffers], payload)

    def set_end_payload(self, slot: int, payload: bytes) -> None:
        _scatter_payload([(h, slot, n) for _, h, n in self.end_buffers + self.state_buffers], payload)

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for _, h, _ in self.page_buffers + self.end_buffers
                   + self.state_buffers)

    # ---- pages ------------------------------------------------------------------------------------
    def write_pages(self, device_pages: list, host_pages: list) -> int:
        rows = _Rows(self.device)
        return sum(self._move(dev, host, rows, device_pages, host_pages, n, to_host=True)
                   for dev, host, n in self.page_buffers)

    def read_pages(self, host_pages: list, device_pages: list, layer: Optional[int] = None,
                   rows: Optional[_Rows] = None) -> int:
        """Host pages to device pages: every buffer's rows, or (`layer`) that layer's; `rows`: the copy's indices."""
        rows = rows or _Rows(self.device)
        return sum(self._move(dev, host, rows, device_pages, host_pages, n, to_host=False)
                   for lid, (dev, host, n) in zip(self.page_layers, self.page_buffers) if layer in (None, lid))

    # ---- ends ---------------------------------------------------------------------------------------
    def write_end(self, tail_swa: list, state_slot: int, host_end: int) -> int:
        rows = _Rows(self.device)
        swa = rows.rows(tail_swa, on_device=True)
        moved = sum(self._gather_scatter(host, rows.pages([host_end], n, False), dev, swa)
                    for dev, host, n in self.end_buffers)
        return moved + sum(self._gather_scatter(host, rows.pages([host_end], m, False), saved,
                                                rows.pages([state_slot], m, True))
                           for saved, host, m in self.state_buffers)

    def read_end(self, host_end: int, tail_swa: list, state_slot: int, layers=None, state: bool = True,
                 rows: Optional[_Rows] = None) -> int:
        """A host end to window slots and a state slot: the window rows of every layer or of `layers`, and
        (`state`) the CSA state rows; `rows`: the copy's indices."""
        rows = rows or _Rows(self.device)
        swa = rows.rows(tail_swa, on_device=True)
        moved = sum(self._gather_scatter(dev, swa, host, rows.pages([host_end], n, False))
                    for lid, (dev, host, n) in enumerate(self.end_buffers) if layers is None or lid in layers)
        if not state:
            return moved
        return moved + sum(self._gather_scatter(saved, rows.pages([state_slot], m, True), host,
                                                rows.pages([host_end], m, False))
                           for saved, host, m in self.state_buffers)

    def load_stages(self, moves: list, end: Optional[tuple]) -> list:
        """A load in stages, each returning the bytes it moved: first what a prefill reads before its first layer
        (the CSA state rows and the MTP layers' window rows), then each layer's rows, in layer order. `moves`:
        (host pages, device pages) of the nodes loaded, moved as one list; `end`: (host end, window slots, state
        slot) or None. The stages share their row indices (built by the first that needs them)."""
        rows = _Rows(self.device)
        host_pages = [p for host, _ in moves for p in host]
        device_pages = [p for _, dev in moves for p in dev]

        def first():
            if end is None:
                return 0
            return self.read_end(*end, layers=range(self.num_layers, len(self.end_buffers)), rows=rows)

        def layer(i):
            moved = self.read_pages(host_pages, device_pages, layer=i, rows=rows) if host_pages else 0
            return moved + (self.read_end(*end, layers=(i,), state=False, rows=rows) if end is not None else 0)
        return [first] + [lambda i=i: layer(i) for i in range(self.num_layers)]

    # ---- copies (run on the copy engine's stream: mem_cache/tier_copy.py) -------------------------------
    def _move(self, dev: torch.Tensor, host: torch.Tensor, rows: _Rows, device_pages: list, host_pages: list,
              rows_per_page: int, to_host: bool) -> int:
        if self.io_backend == "kernel":
            dev_rows = rows.pages(device_pages, rows_per_page, on_device=True)
            host_rows = rows.pages(host_pages, rows_per_page, on_device=False)
            if to_host:
                return self._gather_scatter(host, host_rows, dev, dev_rows)
            return self._gather_scatter(dev, dev_rows, host, host_rows)
        cuda = self.device.type == "cuda"  # the host buffers are pinned: each page's copy is asynchronous
        n = rows_per_page
        for dp, hp in zip(device_pages, host_pages):  # direct: one copy of each page's contiguous rows
            d, h = int(dp) * n, int(hp) * n
            if to_host:
                host[h:h + n].copy_(dev[d:d + n], non_blocking=cuda)
            else:
                dev[d:d + n].copy_(host[h:h + n], non_blocking=cuda)
        return len(device_pages) * n * dev[0].numel() * dev.element_size()

    def _gather_scatter(self, dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor,
                        src_rows: torch.Tensor) -> int:
        """dst[dst_rows] = src[src_rows]: one gather where src lives, one transfer, one scatter where dst lives. On
        CUDA nothing here waits for the device: host -> device from pinned memory; device -> host into a pinned
        staging buffer, scattered into the host rows once the copy has completed (`take_finish`)."""
        rows = src.index_select(0, _to(src_rows, src.device))
        if dst.device.type == "cpu" and src.device.type == "cuda":
            staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            staging.copy_(rows, non_blocking=True)
            self._finish.append(lambda: dst.index_copy_(0, dst_rows, staging))
        else:
            dst.index_copy_(0, _to(dst_rows, dst.device), _to(rows, dst.device))
        return rows.numel() * rows.element_size()

    def take_finish(self):
        """The host-side half of the copies issued since the last call (None when there is none)."""
        finish, self._finish = self._finish, []
        return (lambda: [f() for f in finish]) if finish else None


class HostTier:
    """The host tier's slots and policy; the radix tree calls it as nodes are inserted, hit and evicted, and the
    allocator (match_prefix) to load a match back."""

    def __init__(self, device_pool, shape: HostTierShape, write_policy: str, io_backend: str) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"--hicache-io-backend must be one of {IO_BACKENDS}, got {io_backend!r}")
        self.shape, self.write_policy = shape, write_policy
        self.pool = HostKVPool(device_pool, shape, io_backend)
        self.pages = PageAllocator(shape.num_pages + 1, "host KV page")
        self.ends = PageAllocator(shape.num_ends + 1, "host prefix end")
        self.stats = HostTierStats()
        self.cache = None  # the RadixCache (set by attach)
        self.files = None  # the file tier below (mem_cache/file_tier.py), when --hicache-storage-backend file
        self.copies = make_copy_engine(self.pool.device)  # every move between the tiers, behind the scheduler

    def attach(self, cache) -> None:
        self.cache = cache
        cache.tier = self

    # ---- writes -------------------------------------------------------------------------------------
    def on_insert(self, node: TreeNode, with_end: bool) -> None:
        if self.write_policy == "write_through":
            self._copy_path(node, with_end)

    def on_hit(self, node: TreeNode) -> None:
        if self.write_policy == "write_through_selective" and node.hits >= _SELECTIVE_HITS:
            self._copy_path(node, with_end=True)

    def offload(self, node: TreeNode) -> bool:
        """The device evicts a node's pages: whether the host holds them (write_back copies them now)."""
        if node.host_pages is None and self.write_policy == "write_back":
            self._write_pages(node)
        return node.host_pages is not None

    def save_end(self, node: TreeNode) -> None:
        """The device drops a node's end (tail and state): write_back copies it now."""
        if node.host_end is None and self.write_policy == "write_back":
            self._write_end(node)

    def _copy_path(self, node: TreeNode, with_end: bool) -> None:
        """Copy a device node and its ancestors the host lacks (a host copy is useful only with its whole path), and
        its end."""
        path, n = [], node
        while n is not self.cache.root and n.host_pages is None:
            path.append(n)
            n = n.parent
        for n in reversed(path):
            if not self._write_pages(n):
                return
        if with_end and node.usable and node.host_end is None:
            self._write_end(node)

    def _write_pages(self, node: TreeNode) -> bool:
        n = len(node.pages)
        if not self._room(self.pages, n, lambda: self.cache.evict_host(n - self.pages.available(), 0)):
            return False
        node.host_pages = self.pages.alloc(n)
        dev, host = list(node.pages), node.host_pages
        self._submit([lambda: self.pool.write_pages(dev, host)], "bytes_to_host",
                     self.files.page_saver(node) if self.files is not None else None)
        return True

    def _write_end(self, node: TreeNode) -> None:
        if not self._room(self.ends, 1, lambda: self.cache.evict_host(0, 1)):
            return
        node.host_end = self.ends.alloc(1)[0]
        node.host_next_token = node.next_token
        tail, slot, end = list(node.tail_swa), node.state_slot, node.host_end
        self._submit([lambda: self.pool.write_end(tail, slot, end)], "bytes_to_host",
                     self.files.end_saver(node) if self.files is not None else None)

    def _room(self, slots: PageAllocator, n: int, evict) -> bool:
        """Whether n host slots are free, after evicting host copies and, for slots held back by copies in flight,
        waiting for them."""
        if slots.available() < n:
            evict()
        if slots.available() < n and slots.available() + self.copies.held(slots) >= n:
            self.copies.drain()
        return slots.available() >= n

    def _submit(self, stages: list, counter: str, then=None, started: Optional[float] = None):
        """Run a copy's stages (each returning the bytes it moved) on the copy engine; once it has landed its bytes
        are counted (`started`: its latency since then) and `then` (the file tier's save of what it wrote to the
        host) runs."""
        moved = [0]

        def staged(stage, last: bool):
            def run():
                moved[0] += stage()
                finish = self.pool.take_finish()
                if not last:
                    return finish

                def done():
                    if finish is not None:
                        finish()
                    setattr(self.stats, counter, getattr(self.stats, counter) + moved[0])
                    if then is not None:
                        self.stats.bytes_to_file += then()
                    if started is not None:
                        self.stats.load_seconds.append(time.perf_counter() - started)
                return done
            return run
        return self.copies.submit(*(staged(s, i == len(stages) - 1) for i, s in enumerate(stages)))

    # ---- freeing (held back while copies are in flight: one may read or fill the slot) --------------
    def free_host_pages(self, node: TreeNode) -> None:
        if node.host_pages is not None:
            self.copies.release(self.pages, node.host_pages)
            node.host_pages = None

    def free_host_end(self, node: TreeNode) -> None:
        if node.host_end is not None:
            self.copies.release(self.ends, [node.host_end])
            node.host_end = node.host_next_token = None

    def free_host(self, node: TreeNode) -> None:
        self.free_host_pages(node)
        self.free_host_end(node)

    def pending_load(self, node: Optional[TreeNode]) -> Optional[CopyTicket]:
        """The last load in flight into a node of node's path (what reading the path waits for), or None."""
        tickets = []
        while node is not None and node is not self.cache.root:
            if node.loading is not None and node.loading.done:
                node.loading = None
            tickets.append(node.loading)
            node = node.parent
        return self.copies.latest(tickets)

    # ---- loads --------------------------------------------------------------------------------------
    def load(self, allocator, match) -> bool:
        """Bring a match's host-only nodes and (load_end) its end's tail and state into free device pages, window
        slots and a state slot; all or nothing (False: nothing loaded, the device could not take it). The slots are
        the nodes' at once; the rows land later, on the copy engine, layer by layer (HostKVPool.load_stages): the
        loaded nodes carry the load's ticket until then (`pending_load`), which whatever reads them waits for."""
        start = time.perf_counter()
        cache, node = self.cache, match.node
        n_pages = sum(len(n.host_pages) for n in match.load)
        w = min(self.pool.window, match.num_tokens)
        n_swa = w if match.load_end else 0
        cache.lock(node)  # the path (its host-only nodes too) stays while the device makes room
        try:
            if n_pages > allocator.available_pages() or n_swa > allocator.available_window_slots():
                return False
            allocator.reclaim(n_pages, n_swa)
            if match.load_end and (node.host_end is None or not allocator.state_slot_ready()):
                return False
            moves, pages, end_rows = [], list(match.pages), None
            for n in match.load:
                device_pages = allocator.pages.alloc(len(n.host_pages))
                moves.append((n.host_pages, device_pages))
                cache._give_pages(n, device_pages)
                pages += device_pages
            if match.load_end:
                swa, slot = allocator.swa_slots.alloc(w), allocator.state_slots.alloc(1)[0]
                end_rows = (node.host_end, swa, slot)
                ps, end = allocator.page_size, match.num_tokens
                tail_full = [pages[p // ps] * ps + p % ps for p in range(end - w, end)]
                allocator.map_window(tail_full, swa)
                cache.set_end(node, tail_full, swa, slot, node.host_next_token)
            match.pages = pages
            ticket = self._submit(self.pool.load_stages(moves, end_rows), "bytes_to_device", started=start)
            for n in match.load + [node]:
                n.loading = ticket
        finally:
            cache.unlock(node)
        self.stats.num_loads += 1
        self.stats.host_hit_tokens += match.num_tokens
        if match.from_file:
            self.stats.file_hit_tokens += match.num_tokens
        return True

    # ---- integrity ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise unless the host slots held are exactly the tree's copies (within the host pool's bound) and the
        file tier's reads for waiting requests."""
        nodes = self.cache.nodes()
        prefetched = self.files.prefetcher.reserved if self.files is not None else (lambda slots: 0)
        held_pages = self.pages.size - 1 - self.pages.available() - self.copies.held(self.pages)
        held_ends = self.ends.size - 1 - self.ends.available() - self.copies.held(self.ends)
        held_pages, held_ends = held_pages - prefetched(self.pages), held_ends - prefetched(self.ends)
        tree_pages = sum(len(n.host_pages) for n in nodes if n.host_pages is not None)
        tree_ends = sum(n.host_end is not None for n in nodes)
        if (held_pages, held_ends) != (tree_pages, tree_ends):
            raise AssertionError(f"host tier leak: {held_pages} page slots and {held_ends} end slots held, the tree's "
                                 f"copies {tree_pages} and {tree_ends}")
        orphans = [n for n in nodes if not n.pages and n.host_pages is None]
        if orphans:
            raise AssertionError(f"{len(orphans)} cached nodes hold their pages on neither tier")

    def describe(self) -> str:
        files = "" if self.files is None else f"; {self.files.describe()}"
        return (f"host tier: {self.shape.nbytes / 2**30:.2f} GiB, {self.shape.num_pages} pages and "
                f"{self.shape.num_ends} prefix ends, --hicache-write-policy {self.write_policy}, --hicache-io-backend "
                f"{self.pool.io_backend}{files}")

