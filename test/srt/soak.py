"""The prefix cache's soak, shared by test_prefix_cache.py (the device alone) and test_hicache.py (with the host
tier): many short multi-turn requests over five chats, the pools checked after every batch, memory flat."""

from __future__ import annotations

import os

from oracle import random_ids


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(eng, num_requests: int, label: str) -> None:
    """Batches of five chats, each turn the chat so far plus 3 greedy tokens and one new token; a chat longer than
    100 tokens is cut back to its first 20 (a turn that reuses a cached prefix). After every batch the allocator holds
    exactly what the cache keeps (check_all_free: with the host tier, its slots are the tree's copies); the process's
    memory is flat after the first third (pools are allocated once; the tree only reuses their slots).
    SGLANG_SOAK_REQUESTS overrides num_requests (1,000 by hand)."""
    num_requests = int(os.environ.get("SGLANG_SOAK_REQUESTS", num_requests))
    history = [random_ids(20, seed=i) for i in range(5)]
    sp = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    rss = []
    for n in range(0, num_requests, 5):
        outs = eng.generate(input_ids=history, sampling_params=sp)
        for h, o in zip(history, outs):
            h += o["output_ids"] + [n % 500 + 2]
            if len(h) > 100:
                del h[20:]
        eng.model_runner.token_allocator.check_all_free()
        rss.append(rss_mb())
    third = len(rss) // 3
    print(f"{label} of {num_requests} requests: RSS {rss[third]:.0f} MB after a third, {rss[-1]:.0f} MB at the end")
    assert rss[-1] - rss[third] < 64, (rss[third], rss[-1])
