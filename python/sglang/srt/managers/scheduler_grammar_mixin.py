"""SchedulerGrammarMixin: the Scheduler's side of constrained requests. A request with a grammar waits in the grammar
queue (constrained/grammar_queue.py) while the grammar compiles in worker threads, and joins the waiting queue once it
has; the scheduler loop never waits on a compile.
"""

from __future__ import annotations

import time
from typing import Optional

from sglang.srt.constrained.grammar_queue import GRAMMAR_POLL_INTERVAL_S, GrammarQueue
from sglang.srt.constrained.xgrammar_backend import make_grammar_backend
from sglang.srt.distributed.parallel_state import get_parallel_state
from sglang.srt.managers.schedule_batch import FinishReason
from sglang.srt.sampling.sampling_params import SamplingParamError


class SchedulerGrammarMixin:
    """Methods of Scheduler (managers/scheduler.py): they use its runner, tokenizer, queues and worker."""

    def _start_grammar_queue(self) -> Optional[GrammarQueue]:
        """The grammar queue, its threads already building the tokenizer info; None when constrained decoding is
        unavailable."""
        kind = self.runner.server_args.grammar_backend
        if kind == "none" or self.tokenizer is None:
            return None
        tokenizer, vocab_size, stop_ids = self.tokenizer, self.config.vocab_size, sorted(self.eos_ids)
        return GrammarQueue(lambda: make_grammar_backend(kind, tokenizer, vocab_size, stop_ids))

    def _grammar_queue(self) -> GrammarQueue:
        """SamplingParamError when constrained decoding is unavailable."""
        if self.grammar_queue is None:
            field = "json_schema"
            if self.runner.server_args.grammar_backend == "none":
                raise SamplingParamError(field, "constrained decoding is off (--grammar-backend none)")
            raise SamplingParamError(field, "constrained decoding needs a tokenizer; this checkpoint has none")
        return self.grammar_queue

    def _grammar(self):
        """The grammar backend, waiting until it is built; SamplingParamError when constrained decoding is
        unavailable."""
        return self._grammar_queue().backend

    def _poll_grammars(self) -> list:
        """Requests whose grammar compiled join the waiting queue; those whose grammar does not compile, or took
        longer than SGLANG_GRAMMAR_TIMEOUT, end with a 400 naming the field (returned). The attention group's first
        rank decides for every rank. With nothing else to run, the step waits a moment for a compile instead of
        spinning."""
        grammars = self.grammar_queue
        if grammars is None or not grammars.jobs:
            return []
        if not (self.waiting or self.running or self.in_flight):
            grammars.wait(GRAMMAR_POLL_INTERVAL_S)
        group = get_parallel_state().attn_tp
        decisions = group.broadcast_object(grammars.decide(time.perf_counter()) if group.rank_in_group == 0 else None)
        ready, refused = grammars.apply(decisions)
        if ready:
            self.grammar_backend = self.worker.grammar = grammars.backend
            # a transferred request decodes once its bytes arrived too (disaggregation/decode_side.py)
            self.waiting.extend(ready if self.disagg is None else self.disagg.grammar_ready(ready))
        for req, decision in refused:
            req.finished_reason = FinishReason("abort", message=decision.message, status_code=decision.status_code,
                                               param=decision.param)
            if self.disagg is not None:
                self.disagg.grammar_refused(req)
        return [req for req, _ in refused]

    def drop_grammar_queue(self) -> list:
        """Take every request still waiting for its grammar out of the queue; returns them."""
        return self.grammar_queue.clear() if self.grammar_queue is not None else []
