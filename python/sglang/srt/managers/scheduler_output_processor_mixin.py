"""SchedulerOutputProcessorMixin: what the Scheduler does with a forward's results. Prompt logprobs are recorded, the
rows that yield a token are sampled (only those: a seeded request draws the same numbers however its prompt was
chunked), each new token is appended and checked against the stop conditions (EOS, stop ids, stop strings across
token boundaries, stop regexes, max_new_tokens, a completed grammar), and a speculative verification's tokens are
committed in order up to the first that finishes the request.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from sglang.srt.layers.sampler import sample
from sglang.srt.managers.schedule_batch import FinishReason, Req, ScheduleBatch
from sglang.srt.sampling.sampling_params import STOP_REGEX_WINDOW, compile_stop_regex, find_stop, search_stop_regex


class SchedulerOutputProcessorMixin:
    """Methods of Scheduler (managers/scheduler.py): they use its tokenizer, eos_ids, grammar_backend and counters."""

    def _process_results(self, batch: ScheduleBatch, forward_batch, output, sampled_rows: tuple) -> list:
        sampled, sampled_row = sampled_rows
        if output.input_token_logprobs is not None:
            values = output.input_token_logprobs.tolist()
            targets = forward_batch.logprob_target_ids.tolist()
        row, updated = 0, []
        for b, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if output.input_token_logprobs is not None:
                for i in range(n):
                    if targets[row + i] >= 0:
                        req.input_token_logprobs.append((req.num_computed + i + 1, values[row + i]))
            row += n
            req.num_computed += n
            if not req.emits_token():
                continue  # a prompt chunk, or a retracted request's prefill: no new token
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = FinishReason("length", length=0)
            else:
                i = sampled_row[b]
                self.append_token(req, sampled.ids[i], sampled.logprobs[i], sampled.top_logprobs[i])
            updated.append(req)
        return updated

    def _sample_emitting(self, batch: ScheduleBatch, output) -> tuple:
        """Sample only the rows that yield a token, so a seeded request draws the same numbers however its prompt
        was chunked or re-prefilled. Returns (SampleOutput, row in it of each request of the batch or None)."""
        emitting = [b for b, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)) if r.emits_token(n)]
        rows = [None] * len(batch.reqs)
        if not emitting:
            return None, rows
        logits = output.next_token_logits
        if len(emitting) < len(batch.reqs):
            logits = logits[torch.tensor(emitting, dtype=torch.int64).to(logits.device, non_blocking=True)]
        sampled = sample(logits, [batch.reqs[b] for b in emitting], self.grammar_backend)
        for i, b in enumerate(emitting):
            rows[b] = i
        return sampled, rows

    def append_token(self, req: Req, token: int, logprob: float, top=None) -> None:
        """Record one generated token and check the stop conditions. A token the request's grammar refuses is not
        recorded (its output and the grammar's accepted tokens stay in step, so an undo rolls back the right count)."""
        if req.grammar is not None and not req.grammar.accept_token(token):
            if not self.grammar_backend.allows_any(req.grammar):  # the client's grammar dead-ends after this prefix
                req.finished_reason = FinishReason(
                    "abort", status_code=400, message=f"the grammar allows no token after {len(req.output_ids)} "
                    "generated tokens: it cannot be completed")
            else:  # masked sampling never draws a refused token
                req.finished_reason = FinishReason("abort", message=f"token {token} breaks the request's grammar",
                                                   status_code=500)
            return
        req.output_ids.append(token)
        req.output_token_logprobs.append(logprob)
        req.output_top_logprobs.append(top)
        self.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        self._check_finished(req)
        if not req.finished and req.grammar is not None and req.grammar.is_terminated():
            req.finished_reason = FinishReason("stop", matched=token)  # the grammar is complete

    def _commit_verified(self, req: Req, tokens: list, logprobs: list) -> None:
        """Append a verification's tokens in order, stopping at the first that finishes the request (the rest are
        dropped); the verification and the tokens it committed count towards the accept length."""
        before = len(req.output_ids)
        for token, logprob in zip(tokens, logprobs):
            self.append_token(req, token, logprob)
            if req.finished:
                break
        committed = len(req.output_ids) - before  # a token the grammar refused is not recorded
        self.num_verify += 1
        self.num_accepted_tokens += committed
        req.spec_num_verify += 1
        req.spec_num_accepted_tokens += committed

    def _check_finished(self, req: Req) -> None:
        token, params = req.output_ids[-1], req.sampling_params
        if len(req.output_ids) < params.min_new_tokens:  # stop conditions apply from min_new_tokens on
            return
        if not params.ignore_eos and token in self.eos_ids:
            req.finished_reason = FinishReason("stop", matched=token)
        elif token in params.stop_token_ids:
            req.finished_reason = FinishReason("stop", matched=token)
        elif params.stop and (matched := self._matched_stop_string(req)) is not None:
            req.finished_reason = FinishReason("stop", matched=matched)
        elif params.stop_regex and (matched := self._matched_stop_regex(req)) is not None:
            req.finished_reason = FinishReason("stop", matched=matched)
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finished_reason = FinishReason("length", length=params.max_new_tokens)

    def _matched_stop_string(self, req: Req) -> Optional[str]:
        """The stop string this token completed (it can span token boundaries); when it completes several, the one
        that starts first (the output is cut before it), then the shortest."""
        stops = req.sampling_params.stop
        tail, floor = self._stop_tail(req, max(len(s) for s in stops) + 8)
        found = [(i, len(s), s) for s in stops if (i := find_stop(tail, s, floor)) >= 0]
        return min(found)[2] if found else None

    def _matched_stop_regex(self, req: Req) -> Optional[str]:
        """The text of a stop_regex match in the text of the last STOP_REGEX_WINDOW tokens (checked after every token,
        so the first match ends the output; a match must fit in that window). Work per token: one decode of the
        window and, per pattern, one RE2 search of it (linear: sampling_params.STOP_REGEX_MAX_PROGRAM bounds the
        programs), a few more while the window holds min_new_tokens text (search_stop_regex)."""
        tail, floor = self._stop_tail(req, STOP_REGEX_WINDOW)
        for pattern in req.sampling_params.stop_regex:
            if (m := search_stop_regex(compile_stop_regex(pattern), tail, floor)) is not None:
                return m.group(0)
        return None

    def _stop_tail(self, req: Req, window: int) -> tuple:
        """(text of the last `window` output tokens, its floor): the floor is the length of the part of it that the
        tokens before the min_new_tokens-th hold (a stop string they complete is no stop: find_stop)."""
        ids, params = req.output_ids, req.sampling_params
        start = max(0, len(ids) - window)
        tail = self.tokenizer.decode(ids[start:], skip_special_tokens=params.skip_special_tokens)
        held = params.min_new_tokens - 1  # tokens whose text cannot hold a stop's end
        floor = (len(self.tokenizer.decode(ids[start:held], skip_special_tokens=params.skip_special_tokens))
                 if held > start else 0)
        return tail, floor
