"""The copies between the prefix cache's tiers (mem_cache/tier_copy.py), on CPU: in submission order, at the next poll
or when waited for, and frees held back until the copies in flight complete; on a GPU (skipped without CUDA; run
through the device tool, scripts/gpu_hicache.sh) the same on a side stream, with no host synchronisation. The
engine's use of them (loads waited for layer by layer, pages under a write not reused, an abort mid-load):
test_hicache.py."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.allocator import PageAllocator
from sglang.srt.mem_cache.tier_copy import CpuCopyEngine, CudaCopyEngine


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device tool)")
def test_cuda_copies_overlap_compute_and_stages_land_in_order():
    """On CUDA: a load's stages run on the side stream behind the compute work queued before it; the compute stream
    waits for the stages it reads (no host synchronisation: sync debug mode "error" throughout), reads them landed,
    and the copy completes at a poll once done; a free made meanwhile comes back then."""
    copies, pool = CudaCopyEngine(torch.device("cuda")), PageAllocator(4, "test")
    src = torch.arange(4 * 4096, dtype=torch.float32).reshape(4, 4096).pin_memory()
    dst = torch.zeros(4, 4096, device="cuda")
    busy = torch.randn(2048, 2048, device="cuda")

    def stage(i):
        def run():
            dst[i].copy_(src[i], non_blocking=True)
        return run

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):  # compute queued before the copy, which runs after it on the side stream
            busy = busy @ busy / 2048
        ticket = copies.submit(*(stage(i) for i in range(4)))
        copies.release(pool, pool.alloc(2))
        copies.wait_device(ticket, 1)  # the compute stream waits for stages 0 and 1 only
        first = dst[:2].clone()
        copies.wait_device(ticket)
        every = dst.clone()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert pool.available() == 1 and copies.held(pool) == 2 and ticket.landed == 4
    torch.cuda.synchronize()
    copies.poll()
    assert ticket.done and not copies.busy() and pool.available() == 3
    assert torch.equal(first.cpu(), src[:2]) and torch.equal(every.cpu(), src)
