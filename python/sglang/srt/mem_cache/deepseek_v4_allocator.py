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

from dataclasses import dataclass, field

import torch

from sglang.srt.mem_cache.allocator import PageAllocator, PoolExhaustedError
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool

_FEW_POSITIONS = 256  # up to this many new positions in a step, extend_batch builds its lists in plain Python


def write_slots_on_device(req_to_token: torch.Tensor, full_to_swa: torch.Tensor, rows: torch.Tensor,
                          positions: torch.Tensor, full: torch.Tensor, swa: torch.Tensor) -> None:
    """req_to_token[rows, positions] = full and full_to_swa[full] = swa (device tensors; no host read)."""
    req_to_token[rows, positions] = full.to(torch.int32)
    full_to_swa[full] = swa


@dataclass
class ReqAllocation:
    """What one request holds. Filled and emptied only by DeepSeekV4TokenAllocator."""

    req_pool_idx: int
    pages: list = field(default_factory=list)
    num_tokens: int = 0  # positions [0, num_tokens) have full slots
    window_start: int = 0  # positions [window_start, num_tokens) hold window slots
    window_slots: list = field(default_factory=list)  # window slot of position window_start + i


class DeepSeekV4TokenAllocator:
    def __init__(self, req_to_token_pool: ReqToTokenPool, num_pages: int, page_size: int, num_swa_slots: int,
                 device) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size
        self.pages = PageAllocator(num_pages, "KV page")
        self.swa_slots = PageAllocator(num_swa_slots, "window KV")
        self.full_to_swa = torch.full((num_pages * page_size,), -1, dtype=torch.int64, device=device)
        self.device = device

    # ---- capacity -------------------------------------------------------------------------------
    def total_pages(self) -> int:
        """Pages a request can use (the reserved dummy page excluded)."""
        return self.pages.size - 1

    def available_pages(self) -> int:
        return self.pages.available()

    def available_window_slots(self) -> int:
        return self.swa_slots.available()

    def available_req_slots(self) -> int:
        return self.req_to_token_pool.available_size()

    def token_usage(self) -> float:
        """Fraction of the pages held."""
        return 1 - self.available_pages() / self.total_pages()

    def is_all_free(self) -> bool:
        """No page, window slot or request slot is held."""
        return self.pages.is_full() and self.swa_slots.is_full() and self.req_to_token_pool.is_full()

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
        return ReqAllocation(req_pool_idx=self.req_to_token_pool.alloc())

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
        if n_pages > self.pages.available():
            raise PoolExhaustedError(self.pages.name, n_pages, self.pages.available())
        if n_new > self.swa_slots.available():
            raise PoolExhaustedError(self.swa_slots.name, n_new, self.swa_slots.available())
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
        lens_t = torch.tensor(lens)
        req = torch.repeat_interleave(torch.arange(len(lens)), lens_t)  # request of each new position
        positions = torch.tensor(starts)[req] + torch.arange(sum(lens)) - (lens_t.cumsum(0) - lens_t)[req]
        page = torch.tensor(pages)[torch.tensor(page_offsets)[req] + positions // self.page_size
                                   - torch.tensor(first_pages)[req]]
        full = page * self.page_size + positions % self.page_size
        return torch.stack((torch.tensor(pool_idx)[req], positions, full, torch.tensor(swa)))

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
        ps = self.page_size
        return [alloc.pages[p // ps] * ps + p % ps for p in range(start, end)]

    def release_window(self, alloc: ReqAllocation, keep_from: int) -> None:
        """Free the window slots of positions < keep_from (they can no longer be in any query's window)."""
        self.release_windows([alloc], [keep_from])

    def release_windows(self, allocs: list, keep_froms: list) -> None:
        """`release_window` for each request of a step: one host -> device copy and one fill for all of them."""
        full, freed = [], []
        for alloc, keep_from in zip(allocs, keep_froms):
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
        self.full_to_swa.index_fill_(0, self._to_device(torch.tensor(full, dtype=torch.int64)), -1)

    def truncate(self, alloc: ReqAllocation, num_tokens: int) -> None:
        """Roll back to positions [0, num_tokens): rejected draft positions give their window slots back and lose
        their full-slot mapping; pages stay (they were reserved at admission). What rejected rows wrote elsewhere
        (compressed entries, staging rows) is position-addressed and rewritten before it is read again."""
        drop = alloc.num_tokens - num_tokens
        if drop <= 0:
            return
        self._unmap(self._full_slots(alloc, num_tokens, alloc.num_tokens))
        keep = max(0, num_tokens - alloc.window_start)
        self.swa_slots.free(alloc.window_slots[keep:])
        del alloc.window_slots[keep:]
        alloc.num_tokens = num_tokens
        if not alloc.window_slots:
            alloc.window_start = num_tokens

    def free_req(self, alloc: ReqAllocation) -> None:
        """Return every page, window slot and the request slot."""
        self.release_window(alloc, alloc.num_tokens)
        self.pages.free(alloc.pages)
        alloc.pages = []
        alloc.num_tokens = alloc.window_start = 0
        self.req_to_token_pool.free(alloc.req_pool_idx)

    # ---- integrity --------------------------------------------------------------------------------
    def check_all_free(self) -> None:
        """Raise if any page, window slot or request slot is still held (call when idle)."""
        problems = []
        if not self.pages.is_full():
            problems.append(f"{self.pages.size - 1 - self.pages.available()} KV pages held")
        if not self.swa_slots.is_full():
            problems.append(f"{self.swa_slots.size - 1 - self.swa_slots.available()} window slots held")
        if not self.req_to_token_pool.is_full():
            problems.append(f"{self.req_to_token_pool.size - self.req_to_token_pool.available_size()} "
                            f"request slots held")
        if bool((self.full_to_swa != -1).any()):
            problems.append("full_to_swa still maps some slots")
        if problems:
            raise AssertionError("memory pool leak: " + "; ".join(problems))
