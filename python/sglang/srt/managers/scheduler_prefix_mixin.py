"""SchedulerPrefixMixin: the Scheduler's side of the prefix cache at admission. A waiting request's prefix that the
file tier holds past the tree is read in the background while it waits (mem_cache/file_prefetch.py); the prefetch
policy says whether admission waits for those reads; at admission the request starts on the longest cached prefix,
what landed included, and its reads still to come are cancelled.
"""

from __future__ import annotations

import functools

from sglang.srt.managers.schedule_batch import Req


class SchedulerPrefixMixin:
    """Methods of Scheduler (managers/scheduler.py): they use its allocator, runner and queues."""

    @staticmethod
    def _prefix_limit(req: Req) -> int:
        """How much of fill_ids a cached prefix may cover: at least one token is left to prefill, and every prompt
        position whose logprob it asked for is computed (its logprob needs the row before it)."""
        n = len(req.fill_ids) - 1
        return n if not req.return_logprob else min(n, req.logprob_start - 1)

    def _start_prefetches(self) -> None:
        """Start the file reads of waiting requests that have not looked for them yet (newly queued or retracted: their
        tokens are hashed behind the scheduler), and plan those whose hashes came back."""
        if self.allocator.prefetcher is None:
            return
        for req in self.waiting:
            if not req.prefetch_started and req.use_prefix_cache:
                req.prefetch_started = True
                req.prefetch = self.allocator.start_prefetch(req.fill_ids, self._prefix_limit(req))
            elif req.prefetch is not None:
                self.allocator.advance_prefetch(req.prefetch)

    def _drop_prefetch(self, req: Req) -> None:
        """Cancel a request's file reads still to come and free their slots (admitted or aborted)."""
        prefetch, req.prefetch = req.prefetch, None
        self.allocator.drop_prefetch(prefetch)

    def _reuse_prefix(self, req: Req) -> None:
        """Start the request on the longest cached prefix it may use (_prefix_limit), its file reads that landed
        included; those still to come are cancelled."""
        cache = self.allocator.cache
        if cache is None or not req.use_prefix_cache:
            return
        tokens = req.fill_ids
        # loads what it needs from the host tier
        match = self.allocator.match_prefix(tokens, self._prefix_limit(req), req.prefetch)
        self._drop_prefetch(req)
        # The tree holds deeper pages of this prompt but no end there (the requests that computed them went on past
        # it): end a chunk there and give the cache that end, for the requests after this one (_cache_running).
        deep = match.path_tokens > match.num_tokens and match.path_tokens >= max(self.allocator.page_size,
                                                                                  self.allocator.window)
        req.split_end = match.path_tokens if deep else 0
        if match.num_tokens == 0:
            return
        cache.lock(match.node)
        req.cache_node = match.node
        self.allocator.attach_prefix(req.alloc, match.pages, match.num_tokens, match.node)
        restore = functools.partial(self.runner.token_to_kv_pool.restore_state, match.node.state_slot,
                                    req.alloc.req_pool_idx, match.num_tokens)
        self.allocator.read_after_loads(req.alloc, match.node, restore)  # now, or once the loads it reads landed
        req.num_computed = req.draft_len = match.num_tokens  # the match's draft rows are the request's own
        if not req.admitted_time:  # the first admission's reuse is what the client is told
            req.cached_tokens = min(match.num_tokens, len(req.origin_input_ids))
