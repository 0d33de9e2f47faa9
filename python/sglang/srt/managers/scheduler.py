"""Scheduler: continuous batching over the ModelRunner (in-process form).

Each step runs one forward: an EXTEND batch when some request still has prompt tokens to prefill (chunks
within --chunked-prefill-size tokens), otherwise a DECODE batch of every running request. Admission reserves
the pages a request can ever need (prompt + max_new_tokens), so a running request never finds the pools
full; the window pool is sized for every request's live window plus one chunk. A finished request returns
every slot it held.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Optional

import torch

from sglang.srt.layers.sampler import sample
from sglang.srt.managers.schedule_batch import FinishReason, Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, model_runner: ModelRunner) -> None:
        self.runner = model_runner
        args = model_runner.server_args
        self.config = model_runner.model_config
        self.allocator = model_runner.token_allocator
        self.chunk_budget = args.chunked_prefill_size if args.chunked_prefill_size > 0 else args.context_length
        self.max_running = args.max_running_requests
        self.context_length = args.context_length
        self.waiting: deque = deque()
        self.running: list = []
        self.eos_ids = set(self.config.eos_token_ids)

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        total = len(req.origin_input_ids) + req.sampling_params.max_new_tokens
        if not req.origin_input_ids:
            raise ValueError("the prompt is empty: give at least one input token")
        if total > self.context_length:
            raise ValueError(f"prompt ({len(req.origin_input_ids)} tokens) + max_new_tokens "
                             f"({req.sampling_params.max_new_tokens}) exceeds the context length "
                             f"{self.context_length}")
        bad = [t for t in req.origin_input_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"input token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if self._pages_for(req) > self.allocator.pages.size - 1:
            raise ValueError(f"request needs {self._pages_for(req)} KV pages, the pool has "
                             f"{self.allocator.pages.size - 1}")
        if req.sampling_params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(req.sampling_params.seed)
        self.waiting.append(req)

    def _pages_for(self, req: Req) -> int:
        total = len(req.origin_input_ids) + req.sampling_params.max_new_tokens
        return -(-total // self.allocator.page_size)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list:
        """Run one forward; returns the requests that finished in it."""
        self._admit()
        batch = self._next_batch()
        return [] if batch is None else self.run_batch(batch)

    def run_batch(self, batch: ScheduleBatch) -> list:
        """Allocate, run and sample one batch of admitted requests; returns those that finished."""
        out_cache_loc = torch.cat([self.allocator.extend(r.alloc, r.num_computed + n)
                                   for r, n in zip(batch.reqs, batch.extend_lens)])
        fb = batch.to_forward_batch(out_cache_loc, self.runner.device)
        output = self.runner.forward(fb)
        ids, logprobs = sample(output.next_token_logits, [r.sampling_params for r in batch.reqs],
                               [r.generator for r in batch.reqs])
        return self._process_results(batch, fb, output, ids.tolist(), logprobs.tolist())

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = self._pages_for(req)
            if need > self.allocator.pages.available() - self._outstanding_pages() \
                    or self.allocator.req_to_token_pool.available_size() == 0:
                break
            self.waiting.popleft()
            req.alloc = self.allocator.alloc_req()
            self.running.append(req)

    def _outstanding_pages(self) -> int:
        """Pages running requests may still allocate (reserved at admission, so decode never runs out)."""
        return sum(self._pages_for(r) - len(r.alloc.pages) for r in self.running)

    def _next_batch(self) -> Optional[ScheduleBatch]:
        prefilling = [r for r in self.running if not r.prefill_done]
        if prefilling:
            reqs, lens, budget = [], [], self.chunk_budget
            window_free = self.allocator.swa_slots.available()
            for req in prefilling:
                n = min(len(req.origin_input_ids) - req.num_computed, budget, window_free)
                if n <= 0:
                    break
                reqs.append(req)
                lens.append(n)
                budget -= n
                window_free -= n
            if reqs:
                return ScheduleBatch(ForwardMode.EXTEND, reqs, lens)
        decoding = [r for r in self.running if r.prefill_done]
        if decoding:
            return ScheduleBatch(ForwardMode.DECODE, decoding, [1] * len(decoding))
        return None

    # ---- results ------------------------------------------------------------------------------------
    def _process_results(self, batch: ScheduleBatch, fb, output, ids: list, logprobs: list) -> list:
        if output.input_token_logprobs is not None:
            values = output.input_token_logprobs.tolist()
            targets = fb.logprob_target_ids.tolist()
        row, finished = 0, []
        for b, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if output.input_token_logprobs is not None:
                for i in range(n):
                    if targets[row + i] >= 0:
                        req.input_token_logprobs.append((req.num_computed + i + 1, values[row + i]))
            row += n
            req.num_computed += n
            self.allocator.release_window(req.alloc, req.num_computed - (self.config.sliding_window - 1))
            if not req.prefill_done:
                continue  # a chunk in the middle of the prompt: its sample is not a token
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = FinishReason("length", length=0)
            else:
                req.output_ids.append(ids[b])
                req.output_token_logprobs.append(logprobs[b])
                self._check_finished(req)
            if req.finished:
                finished.append(req)
        for req in finished:
            self.free_request(req)
        return finished

    def _check_finished(self, req: Req) -> None:
        token, params = req.output_ids[-1], req.sampling_params
        if not params.ignore_eos and token in self.eos_ids:
            req.finished_reason = FinishReason("stop", matched=token)
        elif token in params.stop_token_ids:
            req.finished_reason = FinishReason("stop", matched=token)
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finished_reason = FinishReason("length", length=params.max_new_tokens)

    def free_request(self, req: Req) -> None:
        """Return every slot of a running request (finished, aborted or failed)."""
        if req in self.running:
            self.running.remove(req)
        if req.alloc is not None:
            self.allocator.free_req(req.alloc)
            req.alloc = None
