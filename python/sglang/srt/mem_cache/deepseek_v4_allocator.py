"""DeepSeekV4TokenAllocator: pages of virtual full-token slots plus live window slots, per request.

- Pages (`page_size` raw tokens): a request's positions [0, n) map to `req_to_token[req, p] =
  page * page_size + p % page_size`. A page also owns `page_size / m` compressed entries in every ratio-m
  layer, so this one allocator serves all compressed pools and the indexer-key pool.
- Window slots (one per token, own pool sized by --swa-full-tokens-ratio): held only while a token can still
  be in some query's window; `release_window` frees them as the window slides. `full_to_swa` maps a full
  slot to its window slot (-1 once released).
All bookkeeping is host-side; `full_to_swa` and `req_to_token` are device tensors, updated for a whole step's
requests from one host -> device copy (`extend_batch` = `plan_extend` on the host + `write_slots`; a decode graph
copies plan_extend's table with its own inputs and writes it in the replay), so the copies do not grow with the batch.
An allocation either succeeds completely or raises PoolExhaustedError with nothing changed. Callers outside
mem_cache/ ask the capacity methods (available_pages, token_usage, is_all_free, ...), not the pools.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from sgl_kernel.dsv4_decode_metadata_ref import write_slots_ref

from sglang.srt import platform as plat
from sglang.srt.layers.gpu_kernels import sgl_kernel_op
from sglang.srt.mem_cache.allocator import PageAllocator, PoolExhaustedError
from sglang.srt.mem_cache.radix_cache import CacheCallbacks, RadixCache, TreeNode
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.mem_cache.tier_copy import TierCopies
from sglang.srt.utils.host_ints import int64_tensor

logger = logging.getLogger(__name__)

_FEW_POSITIONS = 256  # up to this many new positions in a step, extend_batch builds its lists in plain Python


def write_slots_on_device(req_to_token: torch.Tensor, full_to_swa: torch.Tensor, rows: torch.Tensor,
                          positions: torch.Tensor, full: torch.Tensor, swa: torch.Tensor) -> None:
    """req_to_token[rows, positions] = full and full_to_swa[full] = swa (device tensors; no host read): on GPUs one
    sgl_kernel launch (the torch reference takes three, inside every decode graph)."""
    fused = sgl_kernel_op("dsv4_decode_metadata", "dsv4_write_slots") if plat.is_device_tensor(full) else None
    (fused or write_slots_ref)(req_to_token, full_to_swa, rows, positions, full, swa)


@dataclass
class ReqAllocation:
    """What one request holds. Filled and emptied only by DeepSeekV4TokenAllocator."""

    req_pool_idx: int
    pages: list = field(default_factory=list)
    num_tokens: int = 0  # positions [0, num_tokens) have full slots
    window_start: int = 0  # positions [window_start, num_tokens) hold window slots
    window_slots: list = field(default_factory=list)  # window slot of position window_start + i
    cached_pages: set = field(default_factory=set)  # pages the prefix cache owns (read-only here, never freed here)
    tail_node: Optional[TreeNode] = None  # the cache node whose window tail this request still reads ...
    tail_end: int = 0  # ... which ends at this position
    pending: Optional[object] = None  # the last host-tier load its prefix reads (mem_cache/tier_copy.py), in flight
    on_ready: Optional[Callable] = None  # the restore of its CSA state, once that load has landed


class DeepSeekV4TokenAllocator(TierCopies):
    def __init__(self, req_to_token_pool: ReqToTokenPool, num_pages: int, page_size: int, num_swa_slots: int,
                 device, window: int = 0, num_state_slots: int = 0) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size
        self.pages = PageAllocator(num_pages, "KV page")
        self.swa_slots = PageAllocator(num_swa_slots, "window KV")
        self.full_to_swa = torch.full((num_pages * page_size,), -1, dtype=torch.int64, device=device)
        self.device = device
        # Prefix cache (mem_cache/radix_cache.py), when num_state_slots > 0: requests keep the window tail of their
        # last page boundary (what a cached prefix ending there needs), and the cache's unlocked pages and tails
        # count as available, evicted on demand.
        self.window = window
        self.live: dict = {}  # request slot -> ReqAllocation of every live request (their kept tails can be dropped)
        self.state_slots = PageAllocator(num_state_slots + 1, "prefix state") if num_state_slots else None
        self.cache = None
        self.host_tier = None  # under the cache, when --enable-hierarchical-cache
        if self.state_slots is not None:
            self.cache = RadixCache(page_size, window, CacheCallbacks(
                free_pages=lambda ids: self._free(self.pages, ids), free_tail=self._free_tail,
                free_state=lambda s: self._free(self.state_slots, [s])))

    # ---- capacity -------------------------------------------------------------------------------
    def total_pages(self) -> int:
        """Pages a request can use (the reserved dummy page excluded)."""
        return self.pages.size - 1

    def available_pages(self) -> int:
        """Free pages, plus those the prefix cache would give back."""
        return self.pages.available() + self._held(self.pages) + (self.cache.evictable_pages() if self.cache else 0)

    def locked_prefix_pages(self, tokens: list, limit: int) -> int:
        """Pages of the cached prefix a request would start on that are locked (RadixCache.locked_match_pages)."""
        return self.cache.locked_match_pages(tokens, limit) if self.cache is not None else 0

    def available_window_slots(self) -> int:
        """Free window slots, plus the cache's unlocked tails and the boundary tails requests keep for it."""
        if self.cache is None:
            return self.swa_slots.available()
        return (self.swa_slots.available() + self._held(self.swa_slots) + self.cache.evictable_tail_slots()
                + self._kept_tail_slots())

    def _kept_keep_from(self, alloc: ReqAllocation) -> int:
        # window + 2 positions: a query of an overlapped step in flight (one position further) still sees them
        return alloc.num_tokens - self.window - 1

    def _kept_tail_slots(self) -> int:
        return sum(max(0, min(self._kept_keep_from(a), a.num_tokens) - a.window_start) for a in self.live.values())

    def reclaim(self, num_pages: int, num_window_slots: int) -> None:
        """Evict cached prefixes until the free lists hold the request (least recently used first)."""
        if self.cache is None:
            return
        # slots held back by copies in flight count: they are waited for last, if still needed
        free_slots, free_pages = (lambda: self.swa_slots.available() + self._held(self.swa_slots),
                                  lambda: self.pages.available() + self._held(self.pages))
        if num_window_slots > free_slots():
            self.cache.evict_tails(num_window_slots - free_slots())
        if num_window_slots > free_slots():  # then the tails requests keep for the cache
            for alloc in self.live.values():
                self._drop_window(alloc, self._kept_keep_from(alloc))
        if num_pages > free_pages():
            self.cache.evict_pages(num_pages - free_pages())
        if num_pages > self.pages.available() or num_window_slots > self.swa_slots.available():
            self._drain()

    def available_req_slots(self) -> int:
        return self.req_to_token_pool.available_size()

    def token_usage(self) -> float:
        """Fraction of the pages held."""
        return 1 - self.available_pages() / self.total_pages()

    def is_all_free(self) -> bool:
        """No request holds a page, window slot, prefix-state slot or request slot (what the prefix cache keeps is
        reusable, not held; `flush_cache` gives it back too). Counters only: the scheduler reports it every step."""
        cached_pages = self.cache.num_pages if self.cache else 0
        cached_slots = self.cache.num_tail_slots if self.cache else 0
        cached_states = self.cache.num_state_slots if self.cache else 0
        states = self.state_slots
        return (self.pages.available() + self._held(self.pages) + cached_pages == self.pages.size - 1
                and self.swa_slots.available() + self._held(self.swa_slots) + cached_slots == self.swa_slots.size - 1
                and (states is None or states.available() + self._held(states) + cached_states == states.size - 1)
                and self.req_to_token_pool.is_full())

    def pages_needed(self, alloc: ReqAllocation | None, new_num_tokens: int) -> int:
        have = len(alloc.pages) if alloc else 0
        return max(0, -(-new_num_tokens // self.page_size) - have)

    def can_extend(self, alloc: ReqAllocation | None, new_num_tokens: int) -> bool:
        current = alloc.num_tokens if alloc else 0
        return (self.pages_needed(alloc, new_num_tokens) <= self.pages.available()
                and new_num_tokens - current <= self.swa_slots.available())

    # ---- request lifecycle --------------------------------------------------------------------
    def alloc_req(self) -> ReqAllocation:
        if self.req_to_token_pool.available_size() == 0:
            raise PoolExhaustedError("request", 1, 0)
        alloc = ReqAllocation(req_pool_idx=self.req_to_token_pool.alloc())
        self.live[alloc.req_pool_idx] = alloc
        return alloc

    def extend(self, alloc: ReqAllocation, new_num_tokens: int) -> torch.Tensor:
        """Give positions [alloc.num_tokens, new_num_tokens) full and window slots; returns their full slots."""
        return self.extend_batch([alloc], [new_num_tokens])

    def extend_batch(self, allocs: list, new_num_tokens: list) -> torch.Tensor:
        """`extend` for each request of a step; returns the new full slots of all of them, in order. The page table
        and window map are written from one host -> device copy (pinned, non-blocking on a GPU). All or nothing: if
        the pools cannot hold every request's new positions, PoolExhaustedError and nothing changed."""
        return self.write_slots(self.plan_extend(allocs, new_num_tokens))

    def plan_extend(self, allocs: list, new_num_tokens: list) -> torch.Tensor:
        """The host half of extend_batch: allocate and book the new positions; returns a host int64 tensor [4, N]
        of (request slot, position, full slot, window slot) per new position, to be written to the device by
        `write_slots` or by whoever copies it there anyway (a decode graph writes them in its replay)."""
        for n in new_num_tokens:
            if n > self.req_to_token_pool.max_context_len:
                raise ValueError(f"sequence length {n} exceeds the context length "
                                 f"{self.req_to_token_pool.max_context_len}")
        n_pages = sum(self.pages_needed(a, n) for a, n in zip(allocs, new_num_tokens))
        n_new = sum(max(0, n - a.num_tokens) for a, n in zip(allocs, new_num_tokens))
        if n_pages > self.available_pages():  # free plus what the prefix cache would give back
            raise PoolExhaustedError(self.pages.name, n_pages, self.available_pages())
        if n_new > self.available_window_slots():
            raise PoolExhaustedError(self.swa_slots.name, n_new, self.available_window_slots())
        self.reclaim(n_pages, n_new)  # nothing changes before it is sure to succeed
        # Host lists per request (a few entries each), then the positions and slots of all of them in a constant
        # number of vectorised host ops: a long prefill chunk costs no Python loop over its tokens.
        grown, pool_idx, starts, lens, first_pages, page_offsets, pages, swa = [], [], [], [], [], [], [], []
        for alloc, n in zip(allocs, new_num_tokens):
            start = alloc.num_tokens
            if n <= start:
                continue
            alloc.pages.extend(self.pages.alloc(self.pages_needed(alloc, n)))
            new_swa = self.swa_slots.alloc(n - start)
            grown.append(alloc)
            pool_idx.append(alloc.req_pool_idx)
            starts.append(start)
            lens.append(n - start)
            first_pages.append(start // self.page_size)
            page_offsets.append(len(pages))
            pages += alloc.pages[start // self.page_size:(n - 1) // self.page_size + 1]  # the pages they fall in
            swa += new_swa
            if not alloc.window_slots:
                alloc.window_start = start
            alloc.window_slots.extend(new_swa)
            alloc.num_tokens = n
        if not lens:
            return torch.empty(4, 0, dtype=torch.int64)
        if sum(lens) <= _FEW_POSITIONS:  # decode and speculative steps: a few positions per request, plain Python
            rows, positions, full = [], [], []
            for alloc, start, n in zip(grown, starts, lens):
                rows += [alloc.req_pool_idx] * n
                positions += range(start, start + n)
                full += self._full_slots(alloc, start, start + n)
            return torch.tensor([rows, positions, full, swa], dtype=torch.int64)
        # A prefill chunk: a constant number of vectorised host ops, no Python loop over its tokens.
        lens_t = int64_tensor(lens)
        req = torch.repeat_interleave(torch.arange(len(lens)), lens_t)  # request of each new position
        positions = int64_tensor(starts)[req] + torch.arange(sum(lens)) - (lens_t.cumsum(0) - lens_t)[req]
        page = int64_tensor(pages)[int64_tensor(page_offsets)[req] + positions // self.page_size
                                   - int64_tensor(first_pages)[req]]
        full = page * self.page_size + positions % self.page_size
        return torch.stack((int64_tensor(pool_idx)[req], positions, full, int64_tensor(swa)))

    def write_slots(self, host: torch.Tensor) -> torch.Tensor:
        """Write plan_extend's positions to the page table and window map (one host -> device copy); returns their
        full slots on the device."""
        if host.shape[1] == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        rows_t, positions_t, full_t, swa_t = self._to_device(host)
        write_slots_on_device(self.req_to_token_pool.req_to_token, self.full_to_swa, rows_t, positions_t, full_t,
                              swa_t)
        return full_t

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """One host -> device copy: pinned and non_blocking on a GPU (the caching host allocator keeps the pinned
        block alive until the copy has run)."""
        if torch.device(self.device).type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _full_slots(self, alloc: ReqAllocation, start: int, end: int) -> list:
        """Full slots of positions [start, end) of a request, from its host page list (what extend wrote)."""
        ps, out = self.page_size, []
        while start < end:  # page by page: ranges extend in C (a released window spans thousands of positions)
            stop = min(end, (start // ps + 1) * ps)
            first = alloc.pages[start // ps] * ps + start % ps
            out.extend(range(first, first + stop - start))
            start = stop
        return out

    def release_window(self, alloc: ReqAllocation, keep_from: int) -> None:
        """Free the window slots of positions < keep_from (they can no longer be in any query's window)."""
        self.release_windows([alloc], [keep_from])

    def release_windows(self, allocs: list, keep_froms: list, keep_boundary_tails: bool = True) -> None:
        """`release_window` for each request of a step: one host -> device copy and one fill for all of them."""
        full, freed = [], []
        # With the prefix cache, keep the tail of each request's last page boundary (a cached prefix may end there),
        # while the window pool is at most 3/4 used: running requests come first.
        keep_tails = (keep_boundary_tails and self.cache is not None
                      and self.swa_slots.available() * 4 >= self.swa_slots.size)
        for alloc, keep_from in zip(allocs, keep_froms):
            if alloc.tail_node is not None and keep_from >= alloc.tail_end:  # past the cached tail: evictable now
                self._unread_tail(alloc)
            if keep_tails:
                keep_from = min(keep_from, alloc.num_tokens // self.page_size * self.page_size - self.window)
            drop = min(keep_from, alloc.num_tokens) - alloc.window_start
            if drop <= 0:
                continue
            full += self._full_slots(alloc, alloc.window_start, alloc.window_start + drop)
            freed += alloc.window_slots[:drop]
            del alloc.window_slots[:drop]
            alloc.window_start += drop
        if full:
            self._unmap(full)
            self.swa_slots.free(freed)

    def _unmap(self, full: list) -> None:
        # index_fill_, not `[full] = -1`: that copies the scalar to the device (a synchronisation)
        self.full_to_swa.index_fill_(0, self._to_device(int64_tensor(full)), -1)

    def truncate(self, alloc: ReqAllocation, num_tokens: int) -> None:
        """Roll back to positions [0, num_tokens): rejected draft positions give their window slots back and lose
        their full-slot mapping; pages stay (they were reserved at admission). What rejected rows wrote elsewhere
        (compressed entries, staging rows) is position-addressed and rewritten before it is read again."""
        self.truncate_batch([alloc], [num_tokens])

    def truncate_batch(self, allocs: list, num_tokens: list) -> None:
        """`truncate` for each request of a speculative cycle: one host -> device copy and one fill for all of them
        (a launch pair per request with rejected drafts cost more host time than the cycle's graph replay)."""
        full = []
        for alloc, n in zip(allocs, num_tokens):
            if alloc.num_tokens <= n:
                continue
            full += self._full_slots(alloc, n, alloc.num_tokens)
            keep = max(0, n - alloc.window_start)
            self.swa_slots.free(alloc.window_slots[keep:])
            del alloc.window_slots[keep:]
            alloc.num_tokens = n
            if not alloc.window_slots:
                alloc.window_start = n
        if full:
            self._unmap(full)

    def place_prefilled(self, alloc: ReqAllocation, num_tokens: int, window_from: int) -> None:
        """Give a fresh request positions [0, num_tokens) as if it had computed them, for state computed elsewhere
        (disaggregated prefill): pages for all of them, window slots for [window_from, num_tokens) only. All or
        nothing: PoolExhaustedError and nothing changed when the pools cannot hold it."""
        assert not alloc.pages and alloc.num_tokens == 0 and 0 <= window_from <= num_tokens
        if num_tokens > self.req_to_token_pool.max_context_len:
            raise ValueError(f"sequence length {num_tokens} exceeds the context length "
                             f"{self.req_to_token_pool.max_context_len}")
        n_pages, n_swa = self.pages_needed(alloc, num_tokens), num_tokens - window_from
        if n_pages > self.available_pages():
            raise PoolExhaustedError(self.pages.name, n_pages, self.available_pages())
        if n_swa > self.available_window_slots():
            raise PoolExhaustedError(self.swa_slots.name, n_swa, self.available_window_slots())
        self.reclaim(n_pages, n_swa)
        alloc.pages = self.pages.alloc(n_pages)
        alloc.window_slots = self.swa_slots.alloc(n_swa)
        alloc.num_tokens, alloc.window_start = num_tokens, window_from
        ps = self.page_size
        full = (torch.tensor(alloc.pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)[None, :]).flatten()
        self.req_to_token_pool.req_to_token[alloc.req_pool_idx, :num_tokens] = \
            self._to_device(full[:num_tokens]).to(torch.int32)
        if n_swa:
            mapped = self._to_device(torch.stack((full[window_from:num_tokens],
                                                  torch.tensor(alloc.window_slots, dtype=torch.int64))))
            self.full_to_swa[mapped[0]] = mapped[1]

    def free_req(self, alloc: ReqAllocation) -> None:
        """Return every page (but the prefix cache's), window slot and the request slot."""
        self._drop_window(alloc, alloc.num_tokens)
        self.pages.free([p for p in alloc.pages if p not in alloc.cached_pages])
        alloc.pages, alloc.cached_pages = [], set()
        alloc.num_tokens = alloc.window_start = 0
        self._unread_tail(alloc)
        self.live.pop(alloc.req_pool_idx, None)
        self.req_to_token_pool.free(alloc.req_pool_idx)
        alloc.pending = alloc.on_ready = None  # a load it waited for lands in the cache's pages, not its own

    def _drop_window(self, alloc: ReqAllocation, keep_from: int) -> None:
        """release_window without the prefix cache's tail rule."""
        self.release_windows([alloc], [keep_from], keep_boundary_tails=False)

    # ---- prefix cache ---------------------------------------------------------------------------
    def attach_prefix(self, alloc: ReqAllocation, pages: list, num_tokens: int, node: TreeNode) -> None:
        """Start a fresh request on a cached prefix: its first len(pages) pages (the cache's), positions
        [0, num_tokens) done, its window reading the cached tail through full_to_swa; the caller restores its CSA
        staging state (DeepSeekV4TokenToKVPool.restore_state) and holds a lock on the cache node."""
        assert not alloc.pages and num_tokens == len(pages) * self.page_size
        alloc.pages, alloc.cached_pages = list(pages), set(pages)
        alloc.num_tokens = alloc.window_start = num_tokens
        self._read_tail(alloc, node, num_tokens)
        ps = self.page_size
        full = torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)[None, :]
        row = self.req_to_token_pool.req_to_token[alloc.req_pool_idx]
        row[:num_tokens] = self._to_device(full.flatten()).to(torch.int32)

    def adopt_cached_pages(self, alloc: ReqAllocation, tokens: list, with_window: bool = False) -> Optional[TreeNode]:
        """Where the prefix cache holds the request's computed positions in pages of its own (the same tokens,
        computed earlier by another request, with no usable end where this request's path leaves them), switch the
        request to the cache's pages and free its copies, so the pool holds the prefix once. Pages holding positions
        of its live window move only `with_window` (cache_running, right before the insert that hands their window
        map to the tree with the tail): the cache's full slots then map this request's window slots, which no other
        request or tail may do meanwhile. Returns the deepest node whose pages it now reads (the caller locks it), or
        None when nothing changed."""
        if self.cache is None:
            return None
        ps = self.page_size
        known, node = self.cache.path(tokens[:alloc.num_tokens // ps * ps])
        swaps = [i for i, p in enumerate(known) if alloc.pages[i] != p and alloc.pages[i] not in alloc.cached_pages]
        windowed = [i for i in swaps if (i + 1) * ps > alloc.window_start]
        if windowed and (not with_window or self.cache.has_tail_in({known[i] for i in windowed})):
            swaps = [i for i in swaps if i not in windowed]  # (a cached tail's window already maps those slots)
        if not swaps:
            return None
        positions, new_full, old_moved, new_moved, moved_swa = [], [], [], [], []
        for i in swaps:
            positions += range(i * ps, (i + 1) * ps)
            new_full += range(known[i] * ps, (known[i] + 1) * ps)
            for p in range(max(i * ps, alloc.window_start), min((i + 1) * ps, alloc.num_tokens)):
                old_moved.append(alloc.pages[i] * ps + p % ps)
                new_moved.append(known[i] * ps + p % ps)
                moved_swa.append(alloc.window_slots[p - alloc.window_start])
        dev = self._to_device(torch.tensor([positions, new_full], dtype=torch.int64))
        self.req_to_token_pool.req_to_token[alloc.req_pool_idx, dev[0]] = dev[1].to(torch.int32)
        if old_moved:
            self._unmap(old_moved)
            moved = self._to_device(torch.tensor([new_moved, moved_swa], dtype=torch.int64))
            self.full_to_swa[moved[0]] = moved[1]
        self.pages.free([alloc.pages[i] for i in swaps])
        for i in swaps:
            alloc.pages[i] = known[i]
            alloc.cached_pages.add(known[i])
        return node

    def cache_running(self, alloc: ReqAllocation, tokens: list, save_state,
                      draft_len: Optional[int] = None) -> Optional[TreeNode]:
        """Give the prefix cache tokens[:P] of a request that goes on (P: its last page boundary, at most draft_len
        under speculative decoding; called when its prompt is prefilled): the cache takes the pages it lacked and the
        window tail at P, which the request keeps reading. Returns the node ending at P (the caller locks it), else
        the node of the cache's pages it switched to (adopt_cached_pages), or None."""
        end = self._cache_end(alloc, tokens, draft_len)
        if not self._can_pin_tail(alloc, end) or not self.state_slot_ready():
            return None
        # The tail's pages become the tree's copies where it holds them: the insert below then takes the tail, and
        # with it the window map adopt_cached_pages moved onto the tree's full slots.
        adopted = self.adopt_cached_pages(alloc, tokens[:end], with_window=True)
        given = self._give(alloc, tokens, end, draft_len is not None, save_state)
        if given is None:
            return adopted
        node, end, tail_taken = given
        if tail_taken:  # window slots before P - window are out of every later query's window: free them
            drop = end - alloc.window_start
            self._unmap(self._full_slots(alloc, alloc.window_start, end - self.window))
            self.swa_slots.free(alloc.window_slots[:drop - self.window])
            del alloc.window_slots[:drop]
            alloc.window_start = end
            self._read_tail(alloc, node, end)
        return node

    def _cache_end(self, alloc: ReqAllocation, tokens: list, draft_len: Optional[int]) -> int:
        """The end a request can give the cache: its last page boundary among computed positions (and, speculating,
        positions with the draft's rows: the tail's MTP rows must be the committed tokens')."""
        end = min(len(tokens), alloc.num_tokens, len(tokens) if draft_len is None else draft_len)
        return end // self.page_size * self.page_size

    def _can_pin_tail(self, alloc: ReqAllocation, end: int) -> bool:
        """Whether the window pool affords the cache a running request's tail: the tail stays allocated until the
        request's window has slid past it, so afterwards every live request must still be able to grow to a full
        window (window + 1 slots) from the free slots."""
        w = self.window
        if alloc.window_start > end - w:
            return False
        need = sum(max(0, w + 1 - len(a.window_slots)) for a in self.live.values())
        held, after = len(alloc.window_slots), alloc.num_tokens - end
        need += max(0, w + 1 - after) - max(0, w + 1 - held)
        freed = end - w - alloc.window_start  # positions before the tail: out of every window, freed by the give
        return self.swa_slots.available() + freed >= need

    def _read_tail(self, alloc: ReqAllocation, node: TreeNode, end: int) -> None:
        """The request's window reads `node`'s tail (ending at `end`) until it slides past it."""
        self._unread_tail(alloc)
        self.cache.add_tail_reader(node)
        alloc.tail_node, alloc.tail_end = node, end

    def _unread_tail(self, alloc: ReqAllocation) -> None:
        if alloc.tail_node is not None:
            self.cache.remove_tail_reader(alloc.tail_node)
            alloc.tail_node = None

    def cache_req(self, alloc: ReqAllocation, tokens: list, save_state, draft_len: Optional[int] = None) -> None:
        """Free a finished request, first giving the prefix cache tokens[:P] (P: its last page boundary, at most
        draft_len under speculative decoding) with the window tail and (via `save_state(slot, P)`) the staging state
        there."""
        given = self._give(alloc, tokens, self._cache_end(alloc, tokens, draft_len), draft_len is not None, save_state)
        if given is not None and given[2]:  # the tail [P - window, P) is the cache's now: free the rest of the window
            end, lo = given[1], given[1] - self.window - alloc.window_start
            self._unmap(self._full_slots(alloc, alloc.window_start, end - self.window)
                        + self._full_slots(alloc, end, alloc.num_tokens))
            self.swa_slots.free(alloc.window_slots[:lo] + alloc.window_slots[lo + self.window:])
            alloc.window_slots, alloc.window_start = [], alloc.num_tokens
        self.free_req(alloc)

    def _give(self, alloc: ReqAllocation, tokens: list, end: int, speculative: bool, save_state) -> Optional[tuple]:
        """Insert tokens[:end] with its pages, tail (speculative: and the token after it, which the tail's last MTP
        row was computed with) and state; returns (node, end, whether the cache took the tail) or None. The pages the
        cache took join alloc.cached_pages."""
        ps, w = self.page_size, self.window
        if self.cache is None or end < max(ps, w) or alloc.window_start > end - w:
            return None
        # The tail's window KV is reached through the tree's pages (full_to_swa): where the tree already holds these
        # tokens in other pages (computed twice, concurrently), this request's tail cannot serve it.
        known = self.cache.cached_pages(tokens[:end])
        if any(p != q for p, q in zip(known[(end - w) // ps:], alloc.pages[(end - w) // ps:end // ps])):
            return None
        if not self.state_slot_ready():
            return None
        slot = self.state_slots.alloc(1)[0]
        save_state(slot, end)
        i = end - w - alloc.window_start
        tail_swa = alloc.window_slots[i:i + w]
        tail_full = self._full_slots(alloc, end - w, end)
        pages = alloc.pages[:end // ps]
        node, dup_pages, dup_tail, dup_slot = self.cache.insert(tokens[:end], pages, tail_full, tail_swa, slot,
                                                                tokens[end] if speculative else None)
        alloc.cached_pages |= set(pages) - set(dup_pages)
        if dup_slot is not None:
            self.state_slots.free([dup_slot])
        return node, end, not dup_tail[1]

    def state_slot_ready(self) -> bool:
        """A prefix-state slot is free (evicting the least recently used end's if none is)."""
        if self.state_slots.available() == 0:
            self.cache.evict_tails(1)
        if self.state_slots.available() == 0 and self._held(self.state_slots):
            self._drain()
        return self.state_slots.available() > 0

    def attach_host_tier(self, tier) -> None:
        """Put the host tier (mem_cache/host_tier.py) under the prefix cache."""
        tier.attach(self.cache)
        self.host_tier = tier

    def match_prefix(self, tokens: list, limit: Optional[int] = None, prefetch=None):
        """The prefix cache's match (RadixCache.match_prefix), what it needs from the host tier loaded back to the
        device first; when the device cannot take it, the deepest match on the device alone. `prefetch`: the
        request's file reads (mem_cache/file_prefetch.py), whose node is a file hit."""
        match = self.cache.match_prefix(tokens, limit)
        match.from_file = prefetch is not None and prefetch.node is not None and match.node is prefetch.node
        if match.fallback is not None and not self.host_tier.load(self, match):
            self.cache.hit_tokens -= match.num_tokens - match.fallback.num_tokens
            match = match.fallback
        return match

    def map_window(self, full: list, swa: list) -> None:
        """full_to_swa[full] = swa (one host -> device copy)."""
        mapped = self._to_device(torch.tensor([full, swa], dtype=torch.int64))
        self.full_to_swa[mapped[0]] = mapped[1]

    def _free_tail(self, full: list, swa: list) -> None:
        self._unmap(full)
        self._free(self.swa_slots, swa)

    def close(self) -> None:
        """Finish what outlives the server: the file tier's queued writes."""
        self._drain()
        if self.host_tier is not None and self.host_tier.files is not None:
            self.host_tier.files.store.drain()

    def clear_storage(self) -> Optional[str]:
        """Delete the file tier's files, the copies in flight (which may save files) landed first; the device and host
        tiers keep theirs. Why not, or None when done."""
        if self.host_tier is None or self.host_tier.files is None:
            return ("the hierarchical cache has no storage backend (--hicache-storage-backend file), or it is off "
                    "since a weight update")
        self._drain()
        self.host_tier.files.store.clear()
        return None

    def flush_cache(self, storage: bool = False) -> None:
        """Empty the prefix cache on the device and the host; `storage` (a weight update): the file tier's files too,
        and the file tier is off from then on, since files are named for the checkpoint the server started with
        (/flush_cache leaves the files for the next server)."""
        self._drain()
        self.settle_reads()
        if self.cache is not None:
            self.cache.reset()
        if storage and self.host_tier is not None and self.host_tier.files is not None:
            self.host_tier.files.store.clear()
            self.host_tier.files = None
            logger.warning("prefix cache: the weights changed; the file tier's files are deleted and it is off until "
                           "the server restarts")

    # ---- integrity --------------------------------------------------------------------------------
    def check_all_free(self) -> None:
        """Raise if any page, window slot or request slot is still held by a request (call when idle): what is held
        must be exactly what the prefix cache keeps (nothing after flush_cache)."""
        problems = []
        cached_pages = self.cache.num_pages if self.cache else 0
        cached_slots = self.cache.num_tail_slots if self.cache else 0
        states = self.state_slots
        cached_states = states.size - 1 - states.available() - self._held(states) if states else 0
        held = {p: p.size - 1 - p.available() - self._held(p) for p in (self.pages, self.swa_slots)}
        if held[self.pages] != cached_pages:
            problems.append(f"{held[self.pages]} KV pages held, {cached_pages} of them by the prefix cache")
        if held[self.swa_slots] != cached_slots:
            problems.append(f"{held[self.swa_slots]} window slots held, {cached_slots} of them by the prefix cache")
        if self.cache is not None and cached_states != sum(n.state_slot is not None for n in self.cache.nodes()):
            problems.append(f"{cached_states} prefix-state slots held")
        if self.cache is not None and self.cache.num_state_slots != cached_states:
            problems.append(f"prefix-state counter {self.cache.num_state_slots} != {cached_states} held")
        if self.cache is not None and self.cache.recount() != (self.cache.evictable_pages(),
                                                              self.cache.evictable_tail_slots()):
            problems.append(f"prefix cache counters {self.cache.evictable_pages(), self.cache.evictable_tail_slots()} "
                            f"!= recount {self.cache.recount()}")
        if not self.req_to_token_pool.is_full():
            problems.append(f"{self.req_to_token_pool.size - self.req_to_token_pool.available_size()} "
                            f"request slots held")
        mapped = int((self.full_to_swa != -1).sum())
        if mapped != cached_slots:
            problems.append(f"full_to_swa maps {mapped} slots, the prefix cache's tails {cached_slots}")
        if self.host_tier is not None:
            try:
                self.host_tier.check()
            except AssertionError as e:
                problems.append(str(e))
        if problems:
            raise AssertionError("memory pool leak: " + "; ".join(problems))
