"""The copies between the prefix cache's tiers (mem_cache/tier_copy.py), on CPU: in submission order, at the next poll
or when waited for, and frees held back until the copies in flight complete. The engine's use of them (loads waited
for, pages under a write not reused, an abort mid-load): test_hicache.py."""

from __future__ import annotations

from sglang.srt.mem_cache.allocator import PageAllocator
from sglang.srt.mem_cache.tier_copy import CpuCopyEngine


def test_copy_engine_runs_copies_in_order_and_holds_frees():
    """On CPU a copy runs at the next poll, or when it (or a later one) is waited for, after every copy before it; a
    free made while copies are in flight waits for all of those, counted as held meanwhile."""
    copies, ran, pool = CpuCopyEngine(), [], PageAllocator(8, "test")
    first = copies.submit(lambda: ran.append(1))
    ids = pool.alloc(3)
    copies.release(pool, ids[:2])
    second = copies.submit(lambda: ran.append(2) or (lambda: ran.append("2 landed")))
    copies.release(pool, ids[2:])
    assert ran == [] and pool.available() == 4 and copies.held(pool) == 3 and copies.busy()
    copies.wait(first)
    assert ran == [1] and first.done and not second.done  # the first free waited for the first copy only
    assert pool.available() == 6 and copies.held(pool) == 1
    copies.poll()
    assert ran == [1, 2, "2 landed"] and pool.available() == 7 and copies.held(pool) == 0 and not copies.busy()
    copies.release(pool, pool.alloc(1))  # nothing in flight: freed at once
    assert pool.available() == 7
