"""RadixCache: prefix reuse over DeepSeek-V4's pools, keyed by whole pages of tokens.

A node's key is a run of tokens, a multiple of `page_size`, and it owns the pages holding them: each page carries the
compressed KV of every compressed layer and the indexer keys for its tokens (DeepSeekV4TokenAllocator), so the pages
are the whole history of a prefix. Node ends are page-aligned, and a page is a multiple of every compression ratio,
so at a node's end no compressor window is open: HCA (128:1) has no pending state to keep, CSA (4:1, overlapping)
only the previous window's staging rows. What a continuation needs beyond the pages is kept per usable end, apart
from the pages and freed first under pressure:
- `tail`: the window slots of the `window` tokens before the end (their window KV, mapped by full_to_swa);
- `state_slot`: the saved CSA staging rows at the end (every CSA compressor's previous-window rows).
A match ends at the deepest node end on the prefix's path that still has both; deeper cached pages are recomputed.
Where a request's path leaves the tree inside a node (requests sharing a system prompt but not what follows it), the
tree holds pages there but no end: the request reports that point (`PrefixMatch.path_tokens`), stops a prefill chunk
there, switches to the tree's pages and gives the tree an end (its tail and state) there, which the requests after it
reuse (scheduler `_cache_running`, allocator `adopt_cached_pages`).
Under speculative decoding the tail also holds the MTP layer's window rows, and the last of them (position end - 1)
was computed with the token after the end (`next_token`): an end is usable only by a request whose token there is
the same, so the draft's window is exactly what it would have computed itself.
Nodes are locked (with their ancestors) by the requests using them and evicted least recently used first, leaves
first. All of it is host-side bookkeeping; freeing goes through the callbacks (the allocator owns the pools).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(eq=False)
class TreeNode:
    parent: Optional["TreeNode"]
    key: list  # tokens, a multiple of page_size
    pages: list  # one page per page_size tokens of key
    children: dict = field(default_factory=dict)  # first page's tokens (tuple) -> child
    tail_full: Optional[list] = None  # full slots of the `window` tokens before this node's end ...
    tail_swa: Optional[list] = None  # ... and their window slots
    next_token: Optional[int] = None  # speculative decoding: the token the tail's last MTP row was computed with
    state_slot: Optional[int] = None
    lock_ref: int = 0  # requests using this node's pages (or a descendant's)
    tail_readers: int = 0  # requests whose window still reaches into this node's tail
    last_access: int = 0

    @property
    def usable(self) -> bool:
        return self.tail_swa is not None and self.state_slot is not None


@dataclass
class PrefixMatch:
    num_tokens: int  # tokens reusable (a multiple of page_size; 0: no reuse)
    pages: list  # the pages of those tokens
    node: Optional[TreeNode]  # the usable end (lock it while in use); None when nothing matched
    path_tokens: int = 0  # tokens the tree holds pages for along the path (usable end or not; >= num_tokens)


@dataclass
class CacheCallbacks:
    free_pages: Callable[[list], None]
    free_tail: Callable[[list, list], None]  # (full slots, window slots)
    free_state: Callable[[int], None]


class RadixCache:
    def __init__(self, page_size: int, window: int, callbacks: CacheCallbacks) -> None:
        if page_size % window and window % page_size:
            raise ValueError(f"page size {page_size} and window {window} must divide one another")
        self.page_size, self.window, self.cb = page_size, window, callbacks
        self.root = TreeNode(None, [], [])
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages held by the tree
        self.num_tail_slots = 0
        self.num_state_slots = 0  # saved CSA staging states held by the tree
        # Kept as the tree changes (the scheduler asks every step): pages of unlocked nodes, tail slots of unread ends
        self.num_evictable_pages = 0
        self.num_evictable_tail_slots = 0
        self.hit_tokens = self.queried_tokens = 0

    # ---- lookup --------------------------------------------------------------------------------
    def match_prefix(self, tokens: list, limit: Optional[int] = None) -> PrefixMatch:
        """The longest reusable prefix of tokens[:limit] (limit default: all): page-aligned, ending at a usable
        node end. Counts toward the hit rate."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        limit -= limit % self.page_size
        node, pos, pages = self.root, 0, []
        best = PrefixMatch(0, [], None)
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tuple(tokens[pos:pos + self.page_size]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos, limit)
            pages += child.pages[:n]
            pos += n * self.page_size
            child.last_access = now
            if n < len(child.pages):
                break
            node = child
            if node.usable and (node.next_token is None or (pos < len(tokens) and tokens[pos] == node.next_token)):
                best = PrefixMatch(pos, list(pages), node)
        best.path_tokens = pos
        self.queried_tokens += len(tokens)
        self.hit_tokens += best.num_tokens
        return best

    def cached_pages(self, tokens: list) -> list:
        """The tree's pages along tokens' path (whole pages, usable end or not); no hit counted, nothing touched."""
        return self.path(tokens)[0]

    def path(self, tokens: list) -> tuple:
        """(the tree's pages along tokens' path, the deepest node holding some of them or None); nothing touched."""
        node, pos, pages, last = self.root, 0, [], None
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + self.page_size]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos, len(tokens))
            if n == 0:
                break
            pages += child.pages[:n]
            pos += n * self.page_size
            last = child
            if n < len(child.pages):
                break
            node = child
        return pages, last

    def has_tail_in(self, pages: set) -> bool:
        """Whether a node's window tail lies in one of these pages (their full slots are mapped to its window)."""
        ps = self.page_size
        return any(s // ps in pages for n in self.nodes() if n.tail_full for s in n.tail_full)

    def _common_pages(self, key: list, tokens: list, pos: int, limit: int) -> int:
        ps, n = self.page_size, 0
        while n * ps < len(key) and pos + (n + 1) * ps <= limit and \
                key[n * ps:(n + 1) * ps] == tokens[pos + n * ps:pos + (n + 1) * ps]:
            n += 1
        return n

    # ---- insertion -----------------------------------------------------------------------------
    def insert(self, tokens: list, pages: list, tail_full: list, tail_swa: list, state_slot: int,
               next_token: Optional[int] = None) -> tuple:
        """Cache tokens (page-aligned, one page per page_size tokens) with the tail (and its `next_token`, speculative
        decoding) and state at their end. The
        tree takes what it did not have; returns (the node ending there, then the pages, (tail full, tail window) and
        state slot or None it already had or did not take: the caller's still; pages the caller got from this tree are
        the same ids, not returned)."""
        ps = self.page_size
        assert len(tokens) == len(pages) * ps and len(tail_swa) == len(tail_full) == min(self.window, len(tokens))
        node, pos, dup_pages = self.root, 0, []
        now = next(self._clock)
        while pos < len(tokens):
            first = tuple(tokens[pos:pos + ps])
            child = node.children.get(first)
            if child is None:
                child = TreeNode(node, list(tokens[pos:]), list(pages[pos // ps:]), last_access=now)
                node.children[first] = child
                self.num_pages += len(child.pages)
                self.num_evictable_pages += len(child.pages)
                node, pos = child, len(tokens)
                break
            n = self._common_pages(child.key, tokens, pos, len(tokens))
            if n < len(child.pages):
                child = self._split(child, n)
            dup_pages += [p for p, q in zip(pages[pos // ps:pos // ps + n], child.pages) if p != q]
            child.last_access = now
            node, pos = child, pos + n * ps
        if node.usable or node is self.root:
            return node, dup_pages, (tail_full, tail_swa), state_slot
        if node.tail_swa is not None:  # keep the tree's tail; the state slot is new
            dup_tail = (tail_full, tail_swa)
        else:
            node.tail_full, node.tail_swa, dup_tail = list(tail_full), list(tail_swa), ([], [])
            node.next_token = next_token
            self.num_tail_slots += len(tail_swa)
            if node.tail_readers == 0:
                self.num_evictable_tail_slots += len(tail_swa)
        if node.state_slot is None and state_slot is not None:
            node.state_slot, state_slot = state_slot, None
            self.num_state_slots += 1
        return node, dup_pages, dup_tail, state_slot

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n pages; returns the upper part (no tail or state: not a usable end)."""
        ps = self.page_size
        upper = TreeNode(child.parent, child.key[:n * ps], child.pages[:n], lock_ref=child.lock_ref,
                         last_access=child.last_access)
        child.parent.children[tuple(child.key[:ps])] = upper
        child.key, child.pages, child.parent = child.key[n * ps:], child.pages[n:], upper
        upper.children[tuple(child.key[:ps])] = child
        return upper

    # ---- locking -------------------------------------------------------------------------------
    def lock(self, node: Optional[TreeNode]) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self.num_evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Optional[TreeNode]) -> None:
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "radix cache: unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable_pages += len(node.pages)
            node = node.parent

    def add_tail_reader(self, node: TreeNode) -> None:
        """A request's window reads node's tail (node locked by it): the tail is not evictable meanwhile."""
        if node.tail_readers == 0 and node.tail_swa is not None:
            self.num_evictable_tail_slots -= len(node.tail_swa)
        node.tail_readers += 1

    def remove_tail_reader(self, node: TreeNode) -> None:
        assert node.tail_readers > 0, "radix cache: tail reader removed twice"
        node.tail_readers -= 1
        if node.tail_readers == 0 and node.tail_swa is not None:
            self.num_evictable_tail_slots += len(node.tail_swa)

    # ---- eviction ------------------------------------------------------------------------------
    def nodes(self) -> list:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out[1:]

    def evictable_pages(self) -> int:
        """Pages that evicting every unlocked subtree would free."""
        return self.num_evictable_pages

    def evictable_tail_slots(self) -> int:
        return self.num_evictable_tail_slots

    def recount(self) -> tuple:
        """(evictable pages, evictable tail slots) counted from the nodes: what the running counters must equal."""
        nodes = self.nodes()
        return (sum(len(n.pages) for n in nodes if n.lock_ref == 0),
                sum(len(n.tail_swa) for n in nodes if n.tail_readers == 0 and n.tail_swa is not None))

    def evict_pages(self, num_pages: int) -> int:
        """Free at least num_pages pages (unlocked leaves, least recently used first; a parent left childless joins
        them) or all that can be; returns how many were freed."""
        heap = [(n.last_access, id(n), n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            freed += len(leaf.pages)
            self._drop_end(leaf)
            self.cb.free_pages(leaf.pages)
            self.num_pages -= len(leaf.pages)
            self.num_evictable_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[tuple(leaf.key[:self.page_size])]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def evict_tails(self, num_slots: int) -> int:
        """Free at least num_slots window slots from node ends no request reads, least recently used first (their
        pages stay; a request past a tail locks the node for its pages only); returns how many were freed."""
        freed = 0
        ends = sorted((n for n in self.nodes() if n.tail_readers == 0 and n.tail_swa is not None),
                      key=lambda n: n.last_access)
        for node in ends:
            if freed >= num_slots:
                break
            freed += len(node.tail_swa)
            self._drop_end(node)
        return freed

    def _drop_end(self, node: TreeNode) -> None:
        if node.tail_swa is not None:
            self.cb.free_tail(node.tail_full, node.tail_swa)
            self.num_tail_slots -= len(node.tail_swa)
            if node.tail_readers == 0:
                self.num_evictable_tail_slots -= len(node.tail_swa)
            node.tail_full = node.tail_swa = node.next_token = None
        if node.state_slot is not None:
            self.cb.free_state(node.state_slot)
            node.state_slot = None
            self.num_state_slots -= 1

    def reset(self) -> None:
        """Free everything (no request may hold a lock)."""
        if any(n.lock_ref or n.tail_readers for n in self.nodes()):
            raise RuntimeError("radix cache: cannot flush while requests use cached prefixes")
        self.evict_pages(self.num_pages + 1)
        assert self.num_pages == 0 and self.num_tail_slots == 0 and self.num_state_slots == 0 and not self.root.children

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
