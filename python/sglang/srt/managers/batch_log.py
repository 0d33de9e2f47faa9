"""The log line of each step that prefills, as upstream SGLang prints it, with what a mixed step adds:

    Prefill batch. #new-seq: 1, #new-token: 63, #cached-token: 0, #decode-rows: 1, token usage: 0.01,
    #running-req: 3, #queue-req: 0, step: 116.2 ms      (the tiny model on CPU)

#new-seq: the requests with a prompt chunk in the step; #new-token: their chunks' tokens; #cached-token: the
prefix-cache hits of those whose first chunk it is; #decode-rows: the decoding requests that ride along
(`--enable-mixed-chunk`); step: the step's wall time, its sampling read included. The decoding rows each wait that
long for their next token: what a prompt's arrival costs the running requests' TPOT (docs/prefix-cache.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillBatchLog:
    new_seq: int
    new_tokens: int
    cached_tokens: int
    decode_rows: int

    @classmethod
    def of(cls, batch) -> Optional["PrefillBatchLog"]:
        """The batch's prompt chunks and decoding rows, taken before it runs; None for a batch without a chunk."""
        if not batch.forward_mode.is_extend():
            return None
        chunks = [(r, n) for r, n in zip(batch.reqs, batch.extend_lens) if not r.prefill_done]
        if not chunks:
            return None
        return cls(len(chunks), sum(n for _, n in chunks),
                   sum(r.cached_tokens for r, _ in chunks if r.num_computed == r.cached_tokens),
                   len(batch.reqs) - len(chunks))

    def emit(self, seconds: float, token_usage: float, running: int, queued: int) -> None:
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, #decode-rows: %d, token usage: "
                    "%.2f, #running-req: %d, #queue-req: %d, step: %.1f ms", self.new_seq, self.new_tokens,
                    self.cached_tokens, self.decode_rows, token_usage, running, queued, seconds * 1e3)
