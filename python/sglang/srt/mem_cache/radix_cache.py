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

With the host tier (mem_cache/host_tier.py, --enable-hierarchical-cache) a node's pages may be on the device
(`pages`), on the host (`host_pages`) or both, and its end's tail and state rows likewise (`host_end`). A device node's
ancestors are all on the device (a node leaves the device only once none of its children is there), so a path is
device nodes, then host-only ones. Evicting a device leaf moves it to the host when the tier holds (or takes) a copy,
else it goes with its host-only subtree; the host evicts least recently used copies, dropping host-only leaves
whole. A match may end at an end the host holds: the allocator loads the host-only nodes of its path and the end's
rows back to the device (`PrefixMatch.load`) or, when the device cannot take them, uses `fallback`. With the file
tier under the host (mem_cache/file_tier.py), a waiting request's walk (`walk_prefix`, which touches nothing) goes on
past the tree's path through the files (MatchWalk says where it stopped): what they hold is read into new host-only
nodes in the background (mem_cache/file_prefetch.py), then matched and loaded as any host hit.
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
    host_pages: Optional[list] = None  # the host tier's copy of the pages (None: not on the host)
    host_end: Optional[int] = None  # host slot of the end's tail and state rows
    host_next_token: Optional[int] = None  # `next_token` of that host end
    hits: int = 0  # matches that reached through this node (write_through_selective)
    page_hashes: Optional[list] = None  # the file tier's chain hash after each page (computed when first needed)
    loading: Optional[object] = None  # the host tier's load into its device pages or end, while in flight

    @property
    def usable(self) -> bool:
        return self.tail_swa is not None and self.state_slot is not None


@dataclass
class PrefixMatch:
    num_tokens: int  # tokens reusable (a multiple of page_size; 0: no reuse)
    pages: list  # the pages of those tokens
    node: Optional[TreeNode]  # the usable end (lock it while in use); None when nothing matched
    path_tokens: int = 0  # tokens the tree holds device pages for along the path (usable end or not)
    load: list = field(default_factory=list)  # host-only nodes of the path to load to the device first
    load_end: bool = False  # the end's tail and state are loaded from the host first
    fallback: Optional["PrefixMatch"] = None  # the deepest match on the device alone (set when a load is needed)
    from_file: bool = False  # its end is a node the file tier's prefetch read into the host tier


@dataclass
class MatchWalk:
    """Where a match's walk down the tree stopped, for the file tier's prefetch to go on from
    (mem_cache/file_prefetch.py)."""

    node: Optional[TreeNode]  # the deepest node matched whole, its end at pos (None: the walk stopped inside one)
    pos: int
    pages: list  # device pages of the path
    load: list  # host-only nodes of the path
    file_end: Optional[tuple] = None  # (pos, node, end file) of the deepest node with only a file end
    limit: int = 0  # the page-aligned bound of the match


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
        self.tier = None  # the host tier (HostTier), when on

    # ---- lookup --------------------------------------------------------------------------------
    def match_prefix(self, tokens: list, limit: Optional[int] = None) -> PrefixMatch:
        """The longest reusable prefix of tokens[:limit] (limit default: all): page-aligned, ending at a usable
        node end. Counts toward the hit rate."""
        best, device_best, _ = self._walk(tokens, limit, touch=True)
        if best is not device_best:
            best.fallback = device_best
        self.queried_tokens += len(tokens)
        self.hit_tokens += best.num_tokens
        return best

    def walk_prefix(self, tokens: list, limit: Optional[int] = None) -> tuple:
        """(the match match_prefix would give now, where its walk stopped: MatchWalk), with nothing touched: no
        access time, hit or counter changes (what the file tier's prefetch looks at while a request waits)."""
        best, _, walk = self._walk(tokens, limit, touch=False)
        return best, walk

    def _walk(self, tokens: list, limit: Optional[int], touch: bool, look_in_files: bool = True) -> tuple:
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        limit -= limit % self.page_size
        node, pos, pages, load = self.root, 0, [], []
        best = device_best = PrefixMatch(0, [], None)
        now = next(self._clock) if touch else 0
        device_pos = 0
        files = self.tier.files if self.tier is not None and look_in_files else None
        walk = MatchWalk(self.root, 0, pages, load, limit=limit)
        fits = lambda nxt: nxt is None or (pos < len(tokens) and tokens[pos] == nxt)  # noqa: E731
        while pos < limit:
            child = node.children.get(tuple(tokens[pos:pos + self.page_size]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos, limit)
            whole = n * self.page_size == len(child.key)
            if not child.pages and not whole:  # a host-only node loads whole or not at all
                walk.node = None
                break
            pos += n * self.page_size
            if child.pages:
                pages += child.pages[:n]
                device_pos = pos
            else:
                load.append(child)
            if touch:
                child.last_access = now
                if child.pages:
                    child.hits += 1
                    if self.tier is not None:
                        self.tier.on_hit(child)
            if not whole:
                walk.node = None
                break
            node = walk.node = child
            walk.pos = pos
            if node.usable and fits(node.next_token):
                best = device_best = PrefixMatch(pos, list(pages), node)
            elif self.tier is not None and node.host_end is not None and fits(node.host_next_token):
                best = PrefixMatch(pos, list(pages), node, load=list(load), load_end=not node.usable)
            elif files is not None and not touch and not node.usable and node.host_end is None:
                found = files.end_file(files.node_hashes(node)[-1], tokens, pos)
                if found is not None:
                    walk.file_end = (pos, node, found)
        best.path_tokens = device_best.path_tokens = device_pos
        return best, device_best, walk

    def locked_match_pages(self, tokens: list, limit: Optional[int] = None) -> int:
        """Device pages of the match match_prefix would give now that no eviction can free (their nodes locked: by
        running requests, or by a waiting request's file read); nothing touched. A request starting on that match
        maps them rather than allocating, and available pages do not count them."""
        best, _, _ = self._walk(tokens, limit, touch=False, look_in_files=False)  # admission: no end-file hashing
        node, locked = best.node, 0
        while node is not None and node is not self.root:
            if node.lock_ref > 0:
                locked += len(node.pages)
            node = node.parent
        return locked

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
            if n == 0 or not child.pages:  # the device's pages end there
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
            if n * ps < len(child.key):
                child = self._split(child, n)
            if not child.pages:  # on the host only: the device copy is the caller's
                self._give_pages(child, list(pages[pos // ps:pos // ps + n]))
            dup_pages += [p for p, q in zip(pages[pos // ps:pos // ps + n], child.pages) if p != q]
            child.last_access = now
            node, pos = child, pos + n * ps
        if self.tier is not None and node is not self.root:
            self.tier.on_insert(node, with_end=False)
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
        if self.tier is not None and node.usable:
            self.tier.on_insert(node, with_end=True)
        return node, dup_pages, dup_tail, state_slot

    def _give_pages(self, node: TreeNode, pages: list) -> None:
        """Device pages for a node the host holds (loaded, or computed again by a request)."""
        assert not node.pages and len(pages) * self.page_size == len(node.key)
        node.pages = pages
        self.num_pages += len(pages)
        if node.lock_ref == 0:  # a locked node's pages join the evictable count when it is unlocked
            self.num_evictable_pages += len(pages)

    def set_end(self, node: TreeNode, tail_full: list, tail_swa: list, state_slot: int,
                next_token: Optional[int]) -> None:
        """Give a device node (no device end) the tail and state loaded back from the host."""
        assert node.pages and node.tail_swa is None and node.state_slot is None
        node.tail_full, node.tail_swa, node.state_slot, node.next_token = tail_full, tail_swa, state_slot, next_token
        self.num_tail_slots += len(tail_swa)
        self.num_state_slots += 1
        if node.tail_readers == 0:
            self.num_evictable_tail_slots += len(tail_swa)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n pages; returns the upper part (no tail or state: not a usable end)."""
        ps = self.page_size
        upper = TreeNode(child.parent, child.key[:n * ps], child.pages[:n], lock_ref=child.lock_ref,
                         last_access=child.last_access, hits=child.hits, loading=child.loading)
        child.parent.children[tuple(child.key[:ps])] = upper
        child.key, child.pages, child.parent = child.key[n * ps:], child.pages[n:], upper
        if child.host_pages is not None:
            upper.host_pages, child.host_pages = child.host_pages[:n], child.host_pages[n:]
        if child.page_hashes is not None:
            upper.page_hashes, child.page_hashes = child.page_hashes[:n], child.page_hashes[n:]
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

    @staticmethod
    def _device_leaf(node: TreeNode) -> bool:
        return bool(node.pages) and node.lock_ref == 0 and not any(c.pages for c in node.children.values())

    def evict_pages(self, num_pages: int, offload: bool = True) -> int:
        """Free at least num_pages device pages (unlocked nodes none of whose children is on the device, least recently
        used first; a parent left so joins them) or all that can be; returns how many were freed. With the host tier
        (and `offload`) a node whose pages it holds stays in the tree, on the host only."""
        heap = [(n.last_access, id(n), n) for n in self.nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            freed += len(leaf.pages)
            kept = offload and self.tier is not None and self.tier.offload(leaf)
            self._drop_end(leaf, save=kept)
            self.cb.free_pages(leaf.pages)
            self.num_pages -= len(leaf.pages)
            self.num_evictable_pages -= len(leaf.pages)
            leaf.pages = []
            parent = leaf.parent
            if not kept:
                self._remove(leaf)
            if parent is not self.root and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _remove(self, node: TreeNode) -> None:
        """Take a node off the device (no pages there) out of the tree, with its subtree (all on the host only)."""
        stack = [node]
        while stack:
            n = stack.pop()
            assert not n.pages and n.lock_ref == 0
            if self.tier is not None:
                self.tier.free_host(n)
            stack.extend(n.children.values())
        del node.parent.children[tuple(node.key[:self.page_size])]

    def evict_host(self, num_pages: int, num_ends: int, backed_only: bool = False) -> None:
        """Give the host tier back at least num_pages page slots and num_ends end slots (or all that can be), least
        recently used first: a device node's host copy is dropped; a host-only node goes once it has no children,
        with its end; ends go alone, their pages staying (not those of locked nodes: a load may be reading them).
        `backed_only`: only copies the device also holds (nothing cached is lost)."""
        tier = self.tier
        if num_ends:
            for n in sorted((n for n in self.nodes() if n.host_end is not None and n.lock_ref == 0
                             and (n.usable or not backed_only)), key=self._end_eviction_order)[:num_ends]:
                tier.free_host_end(n)
        if not num_pages:
            return
        heap = [(n.last_access, id(n), n) for n in self.nodes() if n.host_pages is not None
                and (n.pages or (not n.children and n.lock_ref == 0 and not backed_only))]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            freed += len(node.host_pages)
            if node.pages:
                tier.free_host_pages(node)
                continue
            parent = node.parent
            self._remove(node)
            if parent is not self.root and not parent.pages and not parent.children and parent.lock_ref == 0 \
                    and not backed_only:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    @staticmethod
    def _end_eviction_order(node: TreeNode) -> tuple:
        """Which cached end (window tail and state) goes first: ends a path merely passes through (a node with one
        child) before the rest, each least recently used first. A conversation that went on left its earlier turns'
        ends on its path, where only a request branching at exactly that point would start, and every match of its
        next turn touches them: least recently used alone drops the ends of the sessions not yet come around again,
        and each of them misses in turn. Leaf ends (where a conversation resumes) and branch points (a shared system
        prompt's end, where new requests fork) stay least recently used."""
        return (0 if len(node.children) == 1 else 1, node.last_access)

    def evict_tails(self, num_slots: int) -> int:
        """Free at least num_slots window slots from node ends no request reads, in _end_eviction_order (their pages
        stay; a request past a tail locks the node for its pages only); returns how many were freed."""
        freed = 0
        ends = sorted((n for n in self.nodes() if n.tail_readers == 0 and n.tail_swa is not None),
                      key=self._end_eviction_order)
        for node in ends:
            if freed >= num_slots:
                break
            freed += len(node.tail_swa)
            self._drop_end(node, save=True)
        return freed

    def _drop_end(self, node: TreeNode, save: bool = False) -> None:
        """Free a node's device end; `save`: the host tier first keeps a copy (write_back)."""
        if save and self.tier is not None and node.usable:
            self.tier.save_end(node)
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
        if self.tier is not None:  # every tier: the host's copies first, then the device's pages
            for n in self.nodes():
                self.tier.free_host(n)
        self.evict_pages(self.num_pages + 1, offload=False)
        self.root.children.clear()  # nodes left held nothing on either tier
        assert self.num_pages == 0 and self.num_tail_slots == 0 and self.num_state_slots == 0 and not self.root.children

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
