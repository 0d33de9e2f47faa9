"""SGLang's output of one request ({"text", "output_ids", "meta_info"}), shaped in one place for both paths.

`sglang.Engine` shapes a finished Req of its in-process scheduler; the HTTP side's TokenizerManager (also behind
`Engine(launch_subprocess=True)`) shapes the scheduler process's progress messages, chunk by chunk. Both keep an
`OutputState` and ask it for the dict, so the two paths give the same output. meta_info holds `id`,
`prompt_tokens`, `completion_tokens`, `cached_tokens`, `finish_reason` (FinishReason.to_json()), `e2e_latency`,
`spec_accept_length` with speculative decoding, and with return_logprob `output_token_logprobs`,
`output_top_logprobs` (when top_logprobs_num > 0) and `input_token_logprobs`. Logprob entries are SGLang's
(logprob, token id, token text) triples; the text is always None (SGLang fills it only on request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from sglang.srt.sampling.sampling_params import find_stop

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


def input_logprobs_entries(input_ids: list, by_position, logprob_start_len: int) -> list:
    """SGLang's `input_token_logprobs` from the scheduler's (position, logprob) pairs: one entry per prompt
    position from logprob_start_len (-1: the last one); position 0 has no logprob, nor has a position not yet
    computed."""
    start = len(input_ids) - 1 if logprob_start_len < 0 else min(logprob_start_len, len(input_ids) - 1)
    values = dict(by_position or [])
    return [(None if p == 0 else values.get(p), input_ids[p], None) for p in range(start, len(input_ids))]


def trim_stop(text: str, finished_reason: Optional[dict], no_stop_trim: bool, floor: int = 0) -> str:
    """The text cut before the stop string that finished the request (SGLang emits it only with no_stop_trim): its
    first occurrence that ends past text[:floor] (min_new_tokens: sampling_params.find_stop)."""
    matched = finished_reason.get("matched") if finished_reason else None
    if isinstance(matched, str) and not no_stop_trim:
        cut = find_stop(text, matched, floor)
        return text[:cut] if cut >= 0 else text
    return text


def trim_stop_token(ids: list, finished_reason: Optional[dict], no_stop_trim: bool) -> list:
    """The output ids whose text is shown: without the stop token (EOS or a stop_token_ids entry) that finished the
    request, as SGLang's detokenizer (kept in output_ids and shown only with no_stop_trim)."""
    matched = finished_reason.get("matched") if finished_reason else None
    if type(matched) is int and not no_stop_trim and ids and ids[-1] == matched:
        return ids[:-1]
    return ids


def output_text(tokenizer, req: "Req") -> str:
    """The decoded output of a finished Req (empty without a tokenizer), without the stop token or string that
    finished it."""
    if tokenizer is None:
        return ""
    params = req.sampling_params
    reason = req.finished_reason.to_json() if req.finished_reason else None
    text = tokenizer.decode(trim_stop_token(req.output_ids, reason, params.no_stop_trim),
                            skip_special_tokens=params.skip_special_tokens)
    floor = len(tokenizer.decode(req.output_ids[:max(0, params.min_new_tokens - 1)],
                                 skip_special_tokens=params.skip_special_tokens))
    return trim_stop(text, reason, params.no_stop_trim, floor)


@dataclass
class OutputState:
    """What one request has produced so far: a Req's results, or the sum of the scheduler's messages about it."""

    rid: str
    input_ids: list
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    output_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # per output token
    top_logprobs: list = field(default_factory=list)  # per output token: [(logprob, id)] or None
    finished_reason: Optional[dict] = None  # FinishReason.to_json() once finished
    spec_accept_length: Optional[float] = None  # tokens per verification (speculative decoding)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    input_token_logprobs: Optional[list] = None  # shaped entries, see set_input_logprobs
    # a decode server's half of a disaggregated request: the prompt's logprobs are the prefill server's, which the
    # router puts in front of these (none here, so the merged list is the co-located one)
    prompt_logprobs_elsewhere: bool = False

    @classmethod
    def of_req(cls, req: "Req") -> "OutputState":
        state = cls(rid=req.rid, input_ids=req.origin_input_ids, return_logprob=req.return_logprob,
                    logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num,
                    output_ids=req.output_ids, logprobs=req.output_token_logprobs,
                    top_logprobs=req.output_top_logprobs, spec_accept_length=req.spec_accept_length,
                    finished_reason=req.finished_reason.to_json() if req.finished_reason else None,
                    cached_tokens=req.cached_tokens)
        if req.return_logprob:
            state.set_input_logprobs(req.input_token_logprobs)
        return state

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    def set_input_logprobs(self, by_position: Optional[list]) -> None:
        """Shape the scheduler's (position, logprob) pairs into `input_token_logprobs`. Done when they arrive
        (with the first token and at the end), not for every chunk: the list is as long as the prompt."""
        self.input_token_logprobs = [] if self.prompt_logprobs_elsewhere else input_logprobs_entries(
            self.input_ids, by_position, self.logprob_start_len)

    def meta_info(self, e2e_latency: float) -> dict:
        meta = {"id": self.rid, "prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.output_ids),
                "cached_tokens": self.cached_tokens, "finish_reason": self.finished_reason, "e2e_latency": e2e_latency}
        if self.spec_accept_length is not None:
            meta["spec_accept_length"] = self.spec_accept_length
        if self.return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(self.logprobs, self.output_ids)]
            if self.top_logprobs_num:
                meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in top or []] for top in self.top_logprobs]
            if self.input_token_logprobs is None:  # none received yet: every position without its logprob
                self.set_input_logprobs(None)
            meta["input_token_logprobs"] = self.input_token_logprobs
        return meta

    def to_dict(self, text: str, e2e_latency: float) -> dict:
        """SGLang's output dict: `text`, `output_ids` (a copy) and `meta_info`."""
        return {"text": text, "output_ids": list(self.output_ids), "meta_info": self.meta_info(e2e_latency)}
