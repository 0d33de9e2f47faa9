"""RadixCache bookkeeping (host-side): page-aligned matches end only at usable node ends (tail and state alive),
splits keep what each side owns, duplicates come back to the caller, locks protect paths from eviction, LRU
eviction frees leaves first and tails apart from pages, and a flush returns every page, slot and state."""

from __future__ import annotations

import pytest

from sglang.srt.mem_cache.radix_cache import CacheCallbacks, RadixCache

PS, W = 4, 4


class Pools:
    def __init__(self) -> None:
        self.pages, self.swa, self.states = set(), set(), set()

    def callbacks(self) -> CacheCallbacks:
        return CacheCallbacks(free_pages=lambda p: self._free(self.pages, p),
                              free_tail=lambda full, swa: self._free(self.swa, swa),
                              free_state=lambda s: self._free(self.states, [s]))

    @staticmethod
    def _free(held: set, ids) -> None:
        for i in ids:
            assert i in held, f"double free of {i}"
            held.remove(i)


def _insert(cache, pools, tokens, first_page, first_slot, state, pages=None):
    pages = pages or list(range(first_page, first_page + len(tokens) // PS))
    swa = list(range(first_slot, first_slot + W))
    pools.pages.update(pages)
    pools.swa.update(swa)
    pools.states.add(state)
    tail_full = [pages[-1] * PS + i for i in range(W)]  # W == PS: the tail is the last page
    _, dup_pages, (dup_full, dup_swa), dup_state = cache.insert(tokens, pages, tail_full, swa, state)
    pools._free(pools.pages, dup_pages)
    pools._free(pools.swa, dup_swa)
    if dup_state is not None:
        pools._free(pools.states, [dup_state])
    _check_counters(cache)
    return pages


def _check_counters(cache) -> None:
    assert cache.recount() == (cache.evictable_pages(), cache.evictable_tail_slots())


def test_match_insert_split_and_duplicates():
    pools = Pools()
    cache = RadixCache(PS, W, pools.callbacks())
    a = list(range(100, 112))  # three pages
    _insert(cache, pools, a, first_page=1, first_slot=1, state=1)
    m = cache.match_prefix(a + [7, 8, 9])
    assert m.num_tokens == 12 and m.pages == [1, 2, 3]
    # a shorter prompt: the only usable end is past it, so nothing is reusable (but the tree holds two of its pages)
    assert cache.match_prefix(a[:10]).num_tokens == 0 and cache.match_prefix(a[:10]).path_tokens == 8
    pages, node = cache.path(a[:8] + [0] * 4)
    assert pages == [1, 2] and node.key == a and cache.has_tail_in({3}) and not cache.has_tail_in({1, 2})
    # a sibling sharing two pages splits the node; the shared part is not a usable end by itself
    b = a[:8] + [5, 5, 5, 5]
    _insert(cache, pools, b, first_page=10, first_slot=10, state=2, pages=[1, 2, 13])
    assert cache.num_pages == 4 and pools.pages == {1, 2, 3, 13}  # pages 1, 2 were the tree's own: kept
    assert cache.match_prefix(b).num_tokens == 12 and cache.match_prefix(b).pages == [1, 2, 13]
    assert cache.match_prefix(a[:8] + [6] * 4).num_tokens == 0
    # caching the split point itself makes it a usable end (a duplicate page id there comes back)
    _insert(cache, pools, a[:8], first_page=20, first_slot=20, state=3, pages=[1, 21])
    assert pools.pages == {1, 2, 3, 13}
    assert cache.match_prefix(a[:8] + [6] * 4).num_tokens == 8 == cache.match_prefix(a[:8] + [6] * 4).path_tokens
    # the same prefix again: its tail and state are duplicates, returned
    _insert(cache, pools, a, first_page=30, first_slot=30, state=4, pages=[1, 2, 3])
    assert pools.swa == {1, 2, 3, 4, 10, 11, 12, 13, 20, 21, 22, 23} and pools.states == {1, 2, 3}
    assert cache.hit_rate() > 0


def test_locks_eviction_and_flush():
    pools = Pools()
    cache = RadixCache(PS, W, pools.callbacks())
    a, b = list(range(8)), list(range(50, 58))
    _insert(cache, pools, a, first_page=1, first_slot=1, state=1)
    _insert(cache, pools, b, first_page=3, first_slot=5, state=2)
    m = cache.match_prefix(a)
    cache.lock(m.node)
    cache.add_tail_reader(m.node)
    _check_counters(cache)
    assert cache.evictable_tail_slots() == W  # b's tail only: a's is read
    cache.remove_tail_reader(m.node)
    assert cache.evictable_pages() == 2
    assert cache.evict_pages(10) == 2  # only b's leaf
    assert pools.pages == {1, 2} and pools.states == {1} and cache.match_prefix(b).num_tokens == 0
    with pytest.raises(RuntimeError, match="while requests use"):
        cache.reset()
    cache.unlock(m.node)
    _check_counters(cache)
    assert cache.evict_tails(1) == W  # pages stay, the end is no longer usable
    assert cache.num_pages == 2 and cache.match_prefix(a).num_tokens == 0 and not pools.swa and not pools.states
    cache.reset()
    _check_counters(cache)
    assert not pools.pages and cache.num_pages == 0


def test_lru_order():
    pools = Pools()
    cache = RadixCache(PS, W, pools.callbacks())
    seqs = [[i] * 4 for i in range(3)]
    for i, s in enumerate(seqs):
        _insert(cache, pools, s, first_page=i + 1, first_slot=10 * i + 1, state=i + 1)
    cache.match_prefix(seqs[0])  # touched last: evicted last
    cache.evict_pages(1)
    assert cache.match_prefix(seqs[1]).num_tokens == 0 and cache.match_prefix(seqs[0]).num_tokens == 4


def test_ends_a_path_passes_through_go_first():
    """A conversation's earlier turn leaves its end on the path its next turn passes through: evicting ends takes
    those first, though fresher; then least recently used, a shared prompt's end (a branch point, where new requests
    fork) staying while matches keep touching it, stale leaf ends going before it."""
    pools = Pools()
    cache = RadixCache(PS, W, pools.callbacks())
    shared = list(range(100, 104))  # one page: a system prompt, its end where requests fork
    _insert(cache, pools, shared, first_page=1, first_slot=1, state=1)
    one_shot = [shared + [k] * 4 for k in (1, 2)]  # two requests' leaf ends past it
    _insert(cache, pools, one_shot[0], first_page=2, first_slot=5, state=2, pages=[1, 2])
    _insert(cache, pools, one_shot[1], first_page=3, first_slot=9, state=3, pages=[1, 3])
    chat = shared + [3] * 4
    _insert(cache, pools, chat, first_page=4, first_slot=13, state=4, pages=[1, 4])
    _insert(cache, pools, chat + [4] * 4, first_page=5, first_slot=17, state=5, pages=[1, 4, 5])  # its next turn
    cache.match_prefix(one_shot[1] + [0])  # touches the shared end too
    assert cache.evict_tails(1) == W
    assert cache.match_prefix(chat + [0]).num_tokens == 4  # the turn's end went: back to the shared one
    assert cache.match_prefix(chat + [4] * 4 + [0]).num_tokens == 12
    assert cache.evict_tails(1) == W  # least recently used of the rest: the untouched one-shot leaf
    assert cache.match_prefix(one_shot[0] + [0]).num_tokens == 4 and cache.match_prefix(shared + [9]).num_tokens == 4
    _check_counters(cache)
