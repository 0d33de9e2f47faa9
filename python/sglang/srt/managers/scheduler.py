"""Scheduler: continuous batching over the ModelRunner.

Each step runs one forward. While some request still has prompt tokens to prefill, the step is a mixed EXTEND
batch: every decoding request contributes its one row and prefill chunks fill the rest of the
--chunked-prefill-size budget (the requests after the first within --max-prefill-tokens), so a long prompt never
stalls running decodes; --disable-mixed-chunk leaves the decode rows out of such steps. Otherwise it is a DECODE
batch. A request with a grammar joins the queue once its grammar has compiled in worker threads
(scheduler_grammar_mixin.py), so a large schema never stalls the others either.

Admission is by estimate (managers/schedule_policy.py): running requests are expected to generate a decaying share of
their remaining max_new_tokens, so a request without max_tokens does not hold the context length. When a step cannot
get the pages it needs, requests are retracted (fewest generated tokens first): every slot they hold is freed and they
go back to the front of the queue with their generated tokens, to be re-prefilled (prompt + generated tokens but the
last) and resume exactly where they stopped; the client sees only latency. max_new_tokens is clipped to what the pool
holds next to the prompt, so a request alone always fits and the last running request is never retracted. The
window pool is sized for every request's live window plus one chunk. A finished, aborted or failed request returns
every slot it held. A waiting request's prefix on the file tier is read in the background; the prefetch policy says
whether it waits for those reads (scheduler_prefix_mixin.py).

A step that raises fails only the requests that cause it: the step is undone (each request back to its checkpoint,
the slots allocated past its computed tokens released) and the two halves of the batch run again, recursively, so a
request is aborted (500) only when it fails in a step of its own; the others' outputs are those they would have had
without it (greedy and seeded sampling, speculative cycles included). `consecutive_failed_steps` counts the latest
steps in which nothing could be served; the HTTP side reports the server unhealthy when it grows.

Overlap scheduling (default; --disable-overlap-schedule turns it off): a plain DECODE step on the static path is
launched and its sampled tokens are read one step later. While step N runs on the device, the next call launches step
N+1 (same requests; its input tokens are N's sampled ids, still on the device) and only then waits for N and commits
its tokens (stop checks, window release), so the host's bookkeeping overlaps the device's work. A request that
finished at N has had one more row computed at N+1, dropped with its slots. A change of batch (admission, a prefill
chunk, a finished or aborted request) resolves the step in flight first. A step that raises in flight is undone with
the one chained after it and run again synchronously, so the isolation below holds unchanged.

Decoding is the DecodeWorker's scheme: plain, or speculative (EagleWorker). A speculative decode batch is one cycle:
the worker drafts and verifies, the Scheduler commits the accepted tokens, the worker draft-extends the requests
still running. The worker never calls the Scheduler; the Scheduler asks the allocator, never its pools.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.distributed.parallel_state import get_parallel_state
from sglang.srt.layers.sampler import PendingSample, sample_async
from sglang.srt.managers.batch_log import PrefillBatchLog
from sglang.srt.managers.decode_worker import DecodeWorker
from sglang.srt.managers.schedule_policy import NewTokenRatio, clip_max_new_tokens, expected_tokens, retraction_order
from sglang.srt.managers.schedule_batch import FinishReason, Req, ScheduleBatch
from sglang.srt.managers.scheduler_grammar_mixin import SchedulerGrammarMixin
from sglang.srt.managers.scheduler_output_processor_mixin import SchedulerOutputProcessorMixin
from sglang.srt.managers.scheduler_prefix_mixin import SchedulerPrefixMixin
from sglang.srt.managers.scheduler_profiler import SchedulerProfiler
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParamError

logger = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    """A DECODE step launched on the device whose sampled tokens are not read yet (overlap scheduling)."""

    batch: ScheduleBatch
    checkpoints: list  # of its requests before it was launched, rebased once the step before it is committed
    counters: tuple
    pending: PendingSample


def make_decode_worker(model_runner: ModelRunner) -> DecodeWorker:
    if model_runner.server_args.speculative_algorithm is None:
        return DecodeWorker()
    from sglang.srt.speculative.eagle_worker import EagleWorker

    return EagleWorker(model_runner)


class Scheduler(SchedulerOutputProcessorMixin, SchedulerGrammarMixin, SchedulerPrefixMixin):
    def __init__(self, model_runner: ModelRunner, tokenizer=None) -> None:
        self.runner = model_runner
        args = model_runner.server_args
        self.config = model_runner.model_config
        self.allocator = model_runner.token_allocator
        self.tokenizer = tokenizer  # for stop strings; None: stop strings are refused at admission
        self.chunk_budget = args.chunked_prefill_size if args.chunked_prefill_size > 0 else args.context_length
        self.max_prefill_tokens = args.max_prefill_tokens  # a step's prompt tokens past its first request's chunk
        self.mixed_chunk = args.enable_mixed_chunk
        self.max_running = args.max_running_requests
        self.context_length = args.context_length
        self.waiting: deque = deque()
        self.running: list = []
        self.eos_ids = set(self.config.eos_token_ids)
        self.num_generated_tokens = 0  # since start, for throughput metrics
        self.consecutive_failed_steps = 0  # steps in a row in which every request failed
        self._committing = False  # finish_step began: the step's results stand and can no longer be undone
        self.worker = make_decode_worker(model_runner)
        self.num_draft_tokens = self.worker.num_draft_tokens
        self.num_verify = 0  # speculative verifications (one per request per cycle) since start
        self.num_accepted_tokens = 0  # tokens they committed (accepted drafts + bonus)
        self.overlap = not args.disable_overlap_schedule and not self.worker.speculative
        self.in_flight: Optional[InFlightStep] = None
        self.new_token_ratio = NewTokenRatio.from_conservativeness(args.schedule_conservativeness)
        self.clip_max_new_tokens = clip_max_new_tokens()
        self.decode_tokens = max(1, self.num_draft_tokens)  # positions a decode step adds per request
        self.num_retractions = 0  # requests retracted since start
        self.grammar_backend = None  # XGrammarBackend, once the first constrained request is ready
        self.grammar_queue = self._start_grammar_queue()  # constrained requests whose grammar compiles
        self.profiler = SchedulerProfiler(rank=get_parallel_state().rank, on_cuda=self.runner.device.type == "cuda")
        self.disagg = None  # PrefillSide / DecodeSide (disaggregation/) when this server has one role of the two
        self.log_prefill_batches = True  # batch_log; a server: its sending ranks, after warm-up

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request; raises ValueError (nothing queued) when it can never be served."""
        self.check_request(req)
        params = req.sampling_params
        if params.grammar is not None:  # admitted once its grammar compiled (_poll_grammars)
            self._grammar_queue().submit(req, *params.grammar, time.perf_counter())
        else:
            self.waiting.append(req)

    def check_request(self, req: Req) -> None:
        """Raise ValueError when a request can never be served; clip its max_new_tokens to the pool."""
        req.sampling_params.verify()  # whoever built them: a bad value must not reach (and fail) a batch
        n = len(req.origin_input_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one input token")
        if n + req.sampling_params.max_new_tokens + self.num_draft_tokens > self.context_length:
            extra = f" + {self.num_draft_tokens} draft tokens" if self.num_draft_tokens else ""
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({req.sampling_params.max_new_tokens}){extra} "
                             f"exceeds the context length {self.context_length}")
        if any(not 0 <= t < self.config.vocab_size for t in req.sampling_params.logit_bias or ()):
            raise SamplingParamError("logit_bias", f"logit_bias token ids must be in [0, {self.config.vocab_size})")
        bad = next((t for t in req.origin_input_ids if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise ValueError(f"input token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        pool_tokens = self.allocator.total_pages() * self.allocator.page_size
        if n + self.decode_tokens > pool_tokens:
            raise ValueError(f"the prompt ({n} tokens) does not fit the KV pool ({pool_tokens} tokens) with a decode "
                             f"step; shorten it or raise --mem-fraction-static / --max-total-tokens")
        cap = pool_tokens - n - self.num_draft_tokens  # alone in the pool it can always finish: never retracted
        if req.sampling_params.max_new_tokens > cap:  # as upstream: clipped to the pool, a "length" finish there
            req.sampling_params = dataclasses.replace(req.sampling_params, max_new_tokens=cap,
                                                      min_new_tokens=min(cap, req.sampling_params.min_new_tokens))
        if (req.sampling_params.stop or req.sampling_params.stop_regex) and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
        if not 0 <= req.top_logprobs_num <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {req.top_logprobs_num}")
        if req.sampling_params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(req.sampling_params.seed)
        params = req.sampling_params
        if params.grammar is not None:
            self._grammar_queue()  # refused now when constrained decoding is unavailable
        if params.min_new_tokens:  # what may not end the output before it (ids outside the vocab never do)
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
            req.min_tokens_stop_ids = sorted(t for t in stops if 0 <= t < self.config.vocab_size)

    def abort_request(self, rid: str) -> Optional[Req]:
        """Finish a waiting or running request (or one whose grammar compiles) as aborted and free its slots; None if
        unknown."""
        req = self.disagg.abort(rid) if self.disagg is not None else None  # one waiting for (or in) a KV transfer
        if req is not None:
            return req
        req = self.grammar_queue.remove(rid) if self.grammar_queue is not None else None
        if req is not None:  # it holds no slot yet; its compile is dropped unless it started or others share it
            req.finished_reason = FinishReason("abort", message="request aborted")
            return req
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._drop_prefetch(req)  # its file reads cancelled, their host slots freed
                req.finished_reason = FinishReason("abort", message="request aborted")
                return req
        for req in self.running:
            if req.rid == rid:
                req.finished_reason = FinishReason("abort", message="request aborted")
                self.free_request(req)
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight or (self.grammar_queue and self.grammar_queue.jobs)
                    or (self.disagg is not None and self.disagg.has_work()) or self.allocator.copies_in_flight())

    @property
    def mean_accept_length(self) -> Optional[float]:
        """Tokens committed per speculative verification since start; None without speculative decoding."""
        if not self.worker.speculative:
            return None
        return self.num_accepted_tokens / self.num_verify if self.num_verify else 0.0

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list:
        """Run one forward; returns the requests that got a token or finished in it (failed ones included). Under
        overlap scheduling that is the previous step's: this one is launched, and read at the next call. A running
        profile (/start_profile) counts it. Requests refused because their grammar failed are returned too."""
        refused = self._poll_grammars()
        updated = self._step()
        if self.disagg is not None:  # prefilled requests leave for their KV transfer; transfers that ended
            updated = self.disagg.after_step(updated)
        self.profiler.step_done()
        return refused + updated

    def _step(self) -> list:
        self.allocator.poll_copies()  # the host tier's copies that landed give their held slots back
        self._admit()
        prev, self.in_flight = self.in_flight, None
        if prev is not None:  # plan N+1 one position further, without retracting (N's requests are in flight)
            batch = self._next_batch(lag=1, may_retract=False)
            if batch is not None and self._overlappable(batch) and batch.reqs == prev.batch.reqs:
                self.in_flight = self._launch(batch, chained=prev)  # N+1 on the device before N is read
            return self._resolve(prev)  # a changed batch is planned again at the next call, from N's results
        batch = self._next_batch()
        if batch is None:
            self.allocator.wait_for_reads()
            return []
        if self._overlappable(batch):
            self.in_flight = self._launch(batch)
            if self.in_flight is not None:
                return []
        updated, served = self._run_isolating(batch)
        self.consecutive_failed_steps = 0 if served else self.consecutive_failed_steps + 1
        return updated

    # ---- overlap scheduling -------------------------------------------------------------------------
    def _overlappable(self, batch: ScheduleBatch) -> bool:
        """Plain decode on the static path, with no penalties (they read the host's token history)."""
        return (self.overlap and batch.forward_mode.is_decode() and self.runner.can_run_decode_graph(len(batch.reqs))
                and not any(r.sampling_params.has_penalties or r.grammar is not None for r in batch.reqs))

    def _launch(self, batch: ScheduleBatch, chained: Optional[InFlightStep] = None) -> Optional[InFlightStep]:
        """Allocate, run and sample a DECODE batch without reading the device. `chained`: the step in flight before
        it, whose sampled tokens (on the device) are this step's inputs, one position further. None when the launch
        raised (undone; the batch is then run synchronously, where a failing request is isolated)."""
        reqs, lag = batch.reqs, 1 if chained is not None else 0
        checkpoints, counters = [r.checkpoint() for r in reqs], self._counters()
        self.allocator.await_loads([r.alloc for r in reqs], layered=False)  # the tree's pages it switched to
        try:
            slots = self.allocator.plan_extend([r.alloc for r in reqs], [r.num_computed + lag + 1 for r in reqs])
            if chained is None:
                output = self.runner.forward_decode([r.token_at(r.num_computed) for r in reqs], slots)
            else:
                output = self.runner.forward_decode(None, slots, input_ids_device=chained.pending.ids)
            pending = sample_async(output.next_token_logits, reqs)
        except Exception as e:
            logger.warning("an overlapped decode launch failed (%s: %s); the batch runs synchronously",
                           type(e).__name__, e)
            for req, cp in zip(reqs, checkpoints):
                req.restore(cp)
                self.allocator.truncate(req.alloc, req.num_computed + lag)
            return None
        return InFlightStep(batch, checkpoints, counters, pending)

    def _resolve(self, step: InFlightStep) -> list:
        """Wait for a launched step and commit its tokens. If that raises, the step and the one chained after it are
        undone and the step runs again synchronously (the culprit is isolated there)."""
        self._committing = False
        try:
            sampled = step.pending.wait()
            updated = []
            for b, req in enumerate(step.batch.reqs):
                if req.finished:  # finished or aborted while in flight: its token goes with its slots
                    continue
                req.num_computed += 1
                self.append_token(req, sampled.ids[b], sampled.logprobs[b], sampled.top_logprobs[b])
                updated.append(req)
            self.finish_step(step.batch.reqs)
            self.consecutive_failed_steps = 0
            self._rebase(self.in_flight)
            return updated
        except Exception as e:
            if self._committing:
                raise
            logger.warning("an overlapped decode step failed (%s: %s); it runs again synchronously",
                           type(e).__name__, e)
        chained, self.in_flight = self.in_flight, None
        if chained is not None:
            try:
                chained.pending.wait()  # let the device finish it; its tokens are dropped
            except Exception:
                pass
        live = [(r, cp) for r, cp in zip(step.batch.reqs, step.checkpoints) if r.alloc is not None]
        self._roll_back([r for r, _ in live], [cp for _, cp in live], step.counters)
        updated, served = self._run_isolating(ScheduleBatch(ForwardMode.DECODE, [r for r, _ in live],
                                                            [1] * len(live)))
        self.consecutive_failed_steps = 0 if served else self.consecutive_failed_steps + 1
        return updated

    def _rebase(self, chained: Optional[InFlightStep]) -> None:
        """The step launched behind one just committed undoes to after that commit: its failure must not undo tokens
        already sent (unseeded sampling would draw others) nor rerun more positions than the staging rings' slack.
        Each generator's state stays the one at its launch: its draw is undone with it."""
        if chained is not None:
            chained.checkpoints = [r.checkpoint(cp.generator_state)
                                   for r, cp in zip(chained.batch.reqs, chained.checkpoints)]
            chained.counters = self._counters()

    def _run_isolating(self, batch: ScheduleBatch) -> tuple:
        """run_batch; when it raises, undo the step and bisect the batch until the requests that fail alone are
        found; those are aborted. Returns (updated requests, whether any forward succeeded)."""
        # host-tier loads: CSA states restored before their checkpoint; an extend waits for its layers one by one
        self.allocator.await_loads([r.alloc for r in batch.reqs], layered=batch.forward_mode.is_extend())
        checkpoints = [req.checkpoint() for req in batch.reqs]
        counters = self._counters()
        staging = None
        if batch.forward_mode.is_extend():  # prefill chunks may overwrite staging rows that running them again reads
            spans = [(r.alloc.req_pool_idx, r.num_computed, r.num_computed + n)
                     for r, n in zip(batch.reqs, batch.extend_lens)]
            staging = self.runner.token_to_kv_pool.checkpoint_staging(spans)
        self._committing = False
        try:
            return self.run_batch(batch), True
        except Exception as e:
            if self._committing:  # freeing slots failed: a scheduler bug, not a request's fault
                raise
            error = e
        self._roll_back(batch.reqs, checkpoints, counters)
        if staging is not None:
            self.runner.token_to_kv_pool.restore_staging(staging)
        if len(batch.reqs) == 1:
            req = batch.reqs[0]
            logger.error("request %s failed in the model step; it is aborted", req.rid, exc_info=error)
            self.fail_request(req, f"internal error in the model step (request {req.rid}); see the server log")
            return [req], False
        logger.warning("a step of %d requests failed (%s: %s); retrying each half of it to isolate the cause",
                       len(batch.reqs), type(error).__name__, error)
        updated, served = [], False
        for half in batch.split():
            half_updated, half_served = self._run_isolating(half)
            updated += half_updated
            served = served or half_served
        return updated, served

    def _counters(self) -> tuple:
        return self.num_generated_tokens, self.num_verify, self.num_accepted_tokens

    def _roll_back(self, reqs: list, checkpoints: list, counters: tuple) -> None:
        """Undo a step that raised before finish_step: requests back to their checkpoints, the slots of positions
        past num_computed released (pages stay: admission reserved them). What the step wrote into the pools is
        position-addressed and rewritten when the positions are computed again, but for the staging rows a prefill chunk
        wraps onto (restored by _run_isolating; the rings' slack covers a decode step and the one chained after it)."""
        for req, cp in zip(reqs, checkpoints):
            req.restore(cp)
            if req.alloc is not None:
                self.allocator.truncate(req.alloc, req.num_computed)
        self.num_generated_tokens, self.num_verify, self.num_accepted_tokens = counters

    def fail_request(self, req: Req, message: str, status_code: int = 500) -> None:
        """Finish a request as aborted by the server (the client gets `status_code`) and free its slots."""
        req.finished_reason = FinishReason("abort", message=message, status_code=status_code)
        self.free_request(req)

    def run_batch(self, batch: ScheduleBatch) -> list:
        """Allocate, run and sample one batch of admitted requests."""
        if self.worker.speculative and batch.forward_mode.is_decode():
            return self._run_speculative_cycle(batch.reqs)
        started, log = time.perf_counter(), PrefillBatchLog.of(batch) if self.log_prefill_batches else None
        slots = self.allocator.plan_extend([r.alloc for r in batch.reqs],
                                           [r.num_computed + n for r, n in zip(batch.reqs, batch.extend_lens)])
        if batch.forward_mode.is_decode() and self.runner.can_run_decode_graph(len(batch.reqs)):
            forward_batch = None  # static buffers (a replayed CUDA graph on a GPU), which also write the slots
            output = self.runner.forward_decode([r.token_at(r.num_computed) for r in batch.reqs], slots)
        else:
            forward_batch = batch.to_forward_batch(self.allocator.write_slots(slots), self.runner.device)
            forward_batch.capture_hidden = self.worker.capture_hidden
            forward_batch.before_layer = self.allocator.layer_waits([r.alloc for r in batch.reqs])
            output = self.runner.forward(forward_batch)
        updated = self._process_results(batch, forward_batch, output, self._sample_emitting(batch, output))
        self.worker.after_extend(batch, output)  # speculative: the draft's window over the same rows, first drafts
        self.finish_step(batch.reqs)
        if log is not None:
            log.emit(time.perf_counter() - started, self.allocator.token_usage(), len(self.running), len(self.waiting))
        return updated

    def _run_speculative_cycle(self, reqs: list) -> list:
        """The worker drafts and verifies (one device read), the accepted tokens are committed here, then the worker
        rolls back and draft-extends the requests still running."""
        verified = self.worker.verify(reqs)
        for req, tokens, logprobs in zip(reqs, verified.tokens, verified.logprobs):
            self._commit_verified(req, tokens, logprobs)
            req.num_computed += len(tokens)  # x_c and the accepted drafts are real rows
        self.worker.draft_extend(verified)
        self.finish_step(reqs)
        return list(reqs)

    def _admit(self) -> None:
        """Admit waiting requests (first come, first served) while the pages left after what the running requests
        are expected to need hold the next one's prompt and clipped max_new_tokens (schedule_policy.py); those the
        prefetch policy keeps waiting for their file reads are passed over (scheduler_prefix_mixin.py)."""
        if not self.waiting:
            return
        if not self.running and self.in_flight is None:  # idle until now: the estimate starts afresh
            self.new_token_ratio.reset()
        ratio, clip, draft = self.new_token_ratio.value, self.clip_max_new_tokens, self.num_draft_tokens
        budget = self.allocator.available_pages() - sum(
            self.allocator.pages_needed(r.alloc, expected_tokens(r, ratio, clip, draft)) for r in self.running)
        self._start_prefetches()
        reading = []  # requests the prefetch policy keeps waiting for their file reads: passed over, in order
        while self.waiting and len(self.running) < self.max_running and self.allocator.available_req_slots():
            req = self.waiting[0]
            if self.allocator.prefetch_waits(req.prefetch):
                reading.append(self.waiting.popleft())
                continue
            # its prefix's locked pages are in neither: mapped, not allocated, and not among the available ones (a
            # request waiting on them, e.g. on its own file read's path in a pool they fill, would wait forever)
            need = self.allocator.pages_needed(None, expected_tokens(req, 1.0, clip, draft)) - (
                self.allocator.locked_prefix_pages(req.fill_ids, self._prefix_limit(req)) if req.use_prefix_cache
                else 0)
            if need > budget:
                break
            budget -= need
            self.waiting.popleft()
            req.alloc = self.allocator.alloc_req()
            self._reuse_prefix(req)
            req.admitted_time = req.admitted_time or time.perf_counter()
            self.running.append(req)
        self.waiting.extendleft(reversed(reading))

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests run or wait."""
        if not self._idle():
            return False
        self.allocator.flush_cache()
        return True

    def clear_hicache_storage(self) -> Optional[str]:
        """Delete the file tier's files (the device and host tiers keep theirs); why not, or None when done."""
        return self.allocator.clear_storage()

    def update_weights_from_disk(self, model_path: str) -> str:
        """Load another checkpoint of the served model in place (ModelRunner.update_weights_from_disk) and empty the
        prefix cache, whose KV the old weights computed. ValueError while requests run or wait, or for a checkpoint
        that does not fit; returns the message for the client."""
        if not self._idle():
            raise ValueError("cannot update weights while requests are running; retry when the server is idle (or "
                             "send abort_all_requests: true)")
        message = self.runner.update_weights_from_disk(model_path)
        self.allocator.flush_cache(storage=True)
        return message

    def update_weights_from_tensor(self, named_tensors: list) -> str:
        """ModelRunner.update_weights_from_tensor between steps, then the prefix cache emptied (its KV came from the
        old weights); ValueError while requests run or wait, or for tensors that do not fit."""
        if not self._idle():
            raise ValueError("cannot update weights while requests are running; retry when the server is idle")
        message = self.runner.update_weights_from_tensor(named_tensors)
        self.allocator.flush_cache(storage=True)
        return message

    def _idle(self) -> bool:
        while self.in_flight is not None and not self.running and not self.waiting:
            self.step()  # an overlapped step launched past the last requests' end: read and discard it
        return not (self.running or self.waiting or self.in_flight is not None)

    def _cache_running(self, req: Req) -> None:
        """A running request gives the prefix cache its computed positions up to their last page boundary (when its
        prompt is prefilled, and at its split end) so requests sharing them can start there while it runs; first it
        switches to the cache's copies of pages the cache already holds. It locks the node it reads instead of the
        one it matched."""
        adopted = self.allocator.adopt_cached_pages(req.alloc, req.fill_ids)
        if adopted is not None:
            self._relock(req, adopted)
        # speculative: the cache keeps ends only where the MTP's window rows are the committed tokens'
        node = self.allocator.cache_running(req.alloc, req.fill_ids, self._state_saver(req.alloc),
                                            req.draft_len if self.worker.speculative else None)
        if node is not None:
            self._relock(req, node)

    def _relock(self, req: Req, node) -> None:
        self.allocator.cache.lock(node)  # before the unlock: shared ancestors stay locked throughout
        if req.cache_node is not None:
            self.allocator.cache.unlock(req.cache_node)
        req.cache_node = node
        self.allocator.read_after_loads(req.alloc, node)  # its pages may be the tree's, loaded from the host

    def _state_saver(self, alloc):
        """save_state(slot, end) for the allocator: the request's CSA staging rows at `end` into state slot `slot`."""
        pool = self.runner.token_to_kv_pool
        return lambda slot, end: pool.save_state(alloc.req_pool_idx, slot, end)

    def _release(self, req: Req, cache: bool) -> None:
        """Give back a request's slots (to the prefix cache first when `cache`) and its lock on a cached prefix."""
        if cache and self.allocator.cache is not None:
            self.allocator.cache_req(req.alloc, req.fill_ids, self._state_saver(req.alloc),
                                     req.draft_len if self.worker.speculative else None)
        else:
            self.allocator.free_req(req.alloc)
        if req.cache_node is not None:
            self.allocator.cache.unlock(req.cache_node)
            req.cache_node = None
        req.alloc = None

    def _next_batch(self, lag: int = 0, may_retract: bool = True) -> Optional[ScheduleBatch]:
        """The next step's requests: every decoding request's row (`lag` positions further: the step after the one in
        flight), then prefill chunks within the chunk budget and the pages and window slots left. When the decoding
        rows do not fit the pages or window slots, or nothing fits at all, requests are retracted until it does
        (`may_retract`); otherwise None."""
        while True:
            batch, fits = self._plan_batch(lag)
            if fits or not may_retract or len(self.running) <= 1:
                break
            self._retract(retraction_order(self.running)[0])
        if not fits:
            return None
        if batch is not None and batch.forward_mode.is_decode():
            self.new_token_ratio.step()
        return batch

    def _plan_batch(self, lag: int) -> tuple:
        """(batch or None, whether the running requests' pages and window slots allow it)."""
        decoding = [r for r in self.running if r.prefill_done]
        if (self.worker.speculative or not self.mixed_chunk) and any(not r.prefill_done for r in self.running):
            decoding = []  # speculative cycles run on their own, as decode steps without mixed chunks: prefill first
        pages = self.allocator.available_pages() - sum(
            self.allocator.pages_needed(r.alloc, r.num_computed + lag + self.decode_tokens) for r in decoding)
        if pages < 0:
            return None, False
        window_free = self.allocator.available_window_slots() - sum(
            max(0, r.num_computed + lag + self.decode_tokens - r.alloc.num_tokens) for r in decoding)
        if window_free < 0:  # the decoding rows' window slots (cached tails they read are locked): retract
            return None, False
        reqs, lens = list(decoding), [1] * len(decoding)
        budget = self.chunk_budget - len(decoding)
        prefill_room = None  # --max-prefill-tokens: what the requests after the first may add
        page_bound = False  # the first prefill chunk left out was left out for want of pages
        for req in (r for r in self.running if not r.prefill_done):
            room = (len(req.alloc.pages) + pages) * self.allocator.page_size - req.num_computed
            n = min(req.prefill_len - req.num_computed, budget, window_free, room)
            if prefill_room is not None:
                n = min(n, prefill_room)
            if req.split_end > req.num_computed:
                n = min(n, req.split_end - req.num_computed)
            if n <= 0:
                page_bound = room <= 0
                break
            reqs.append(req)
            lens.append(n)
            budget -= n
            prefill_room = (self.max_prefill_tokens if prefill_room is None else prefill_room) - n
            window_free -= n
            pages -= self.allocator.pages_needed(req.alloc, req.num_computed + n)
        if not reqs:
            return None, not page_bound
        mode = ForwardMode.DECODE if len(reqs) == len(decoding) else ForwardMode.EXTEND
        return ScheduleBatch(mode, reqs, lens), True

    def _retract(self, req: Req) -> None:
        """Free every slot of a running request and queue it first, keeping its generated tokens (and its pending
        draft, for speculative decoding): it is re-prefilled and resumes where it stopped. Its prompt logprobs are
        computed again by that prefill."""
        self.running.remove(req)
        self._release(req, cache=False)
        req.num_computed, req.draft_len, req.prompt_cached, req.prefetch_started = 0, 0, False, False
        del req.input_token_logprobs[:]
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        old = self.new_token_ratio.value
        self.new_token_ratio.raise_after_retraction(self.running, self.clip_max_new_tokens)
        logger.info("KV pool full: retracted request %s (%d generated tokens); %d running, new-token ratio %.3f -> "
                    "%.3f", req.rid, len(req.output_ids), len(self.running), old, self.new_token_ratio.value)

    # ---- after a step ---------------------------------------------------------------------------------
    def finish_step(self, reqs: list) -> None:
        """After a step: release window slots that slid out of every window; free finished requests."""
        self._committing = True
        live = []
        for req in reqs:
            if req.finished:
                self.free_request(req)
            elif req.alloc is not None:
                live.append(req)
                if self.allocator.cache is None or not req.use_prefix_cache:
                    continue
                if req.split_end and req.num_computed >= req.split_end:
                    req.split_end = 0
                    self._cache_running(req)
                if req.prefill_done and not req.prompt_cached:
                    req.prompt_cached = True
                    self._cache_running(req)
        self.allocator.release_windows([r.alloc for r in live],
                                       [r.num_computed - (self.config.sliding_window - 1) for r in live])

    def free_request(self, req: Req) -> None:
        """Return every slot of a running request (finished, aborted or failed)."""
        if req in self.running:
            self.running.remove(req)
        self._drop_prefetch(req)  # one failed while it waited: its file reads cancelled
        if req.alloc is not None:  # only what finished normally is cached (a failed step may have left garbage)
            self._release(req, cache=req.use_prefix_cache and req.finished
                          and req.finished_reason.type in ("stop", "length"))
