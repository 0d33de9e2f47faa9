"""DecodeWorker: what the Scheduler asks of its decoding scheme; plain decoding adds nothing to the forwards.

The Scheduler runs every target EXTEND and plain DECODE forward itself, samples and appends the tokens. A worker
adds what its scheme needs around that:
- `num_draft_tokens`: positions past prompt + max_new_tokens a request may occupy (admission reserves them);
- `capture_hidden`: EXTEND forwards keep the target's hidden streams of every row;
- `after_extend(batch, output)`: runs after each EXTEND forward, before its window slots are released;
- `speculative`: decode batches run on their own as draft-verify cycles. Such a worker also has
  `verify(reqs) -> SpecVerifyResult` (draft and verify, one device read) and `draft_extend(result)` (after the
  Scheduler committed the result's tokens: roll back and draft again for the requests still running).
Control flows one way: a worker returns results and never calls the Scheduler.
"""

from __future__ import annotations


class DecodeWorker:
    """Plain decoding: one target forward per token, nothing extra."""

    speculative = False
    num_draft_tokens = 0
    capture_hidden = False
    grammar = None  # the XGrammarBackend, set by the Scheduler once a constrained request arrives

    def after_extend(self, batch, output) -> None:
        """Nothing to do after an EXTEND forward without a draft model."""
