"""ReqToTokenPool: request slots and the map (request, position) -> virtual full-token slot.

A full-token slot is `page * page_size + offset`; there is no per-raw-token KV behind it in DeepSeek-V4, it only
addresses the page table (compressed entries) and the window pool mapping (full_to_swa).
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.allocator import PageAllocator


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        # +1: slot 0 is the reserved dummy request.
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(size + 1, max_context_len, dtype=torch.int32, device=device)
        self._slots = PageAllocator(size + 1, "request")

    def available_size(self) -> int:
        return self._slots.available()

    def alloc(self) -> int:
        return self._slots.alloc(1)[0]

    def free(self, req_pool_idx: int) -> None:
        self._slots.free([req_pool_idx])

    def is_full(self) -> bool:
        return self._slots.is_full()
