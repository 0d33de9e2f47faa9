"""Incremental detokenization with stop-string hold-back (runs in the HTTP process).

Decoding token by token breaks multi-byte characters, so each step decodes a short window of recent tokens and
only extends the text once the window no longer ends in a partial character (U+FFFD). While a request runs, text
that could be the start of one of its stop strings is held back, so a stop string is never emitted, even in part;
once the scheduler reports the matched stop string, the text is cut before it (a matched stop token is not shown
either). With min_new_tokens, a stop that the tokens before the min_new_tokens-th complete is plain text. A stop_regex
match is cut as soon as it is complete, but the start of a match cannot be held back (what a pattern will match is not
known in advance), so a stream may already have shown its first characters.
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.managers.output_shaping import trim_stop, trim_stop_token
from sglang.srt.sampling.sampling_params import compile_stop_regex, find_stop, search_stop_regex


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: Optional[list] = None,
                 no_stop_trim: bool = False, stop_regex: Optional[list] = None, min_new_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.stop_regex = [compile_stop_regex(p) for p in stop_regex or []]
        self.no_stop_trim = no_stop_trim
        self.held_tokens = max(0, min_new_tokens - 1)  # tokens whose text holds no stop (stops start at the next)
        self._floor: Optional[int] = None  # length of their text, once they are all here
        self.ids: list = []
        self.text = ""  # settled text of ids[:read_offset]
        self.prefix_offset = 0  # window start: tokens before it never change the text
        self.read_offset = 0

    def _decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list) -> None:
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def visible_text(self, finished_reason: Optional[dict]) -> str:
        """Text safe to show now: all of it once finished (cut before a matched stop string), else without a
        trailing piece that could still grow into a stop string."""
        if finished_reason is not None:
            shown = trim_stop_token(self.ids, finished_reason, self.no_stop_trim)
            if len(shown) < len(self.ids) and self._decode(self.ids[-1:]):  # a stop token with text (not a skipped
                text = self._decode(shown)  # special one, as EOS usually is): once, the whole text without it
            else:
                text = self.text
                if self.read_offset < len(self.ids):  # a trailing partial character: flush what decodes
                    text += self._decode(self.ids[self.prefix_offset:])[len(self._decode(
                        self.ids[self.prefix_offset:self.read_offset])):]
            return trim_stop(text, finished_reason, self.no_stop_trim, self.floor())
        if not self.no_stop_trim:  # a complete stop string is never shown, even before the finish arrives
            floor = self.floor()
            cuts = [i for i in (find_stop(self.text, stop, floor) for stop in self.stop) if i >= 0]
            cuts += [m.start() for m in (search_stop_regex(r, self.text, floor) for r in self.stop_regex)
                     if m is not None]
            if cuts:
                return self.text[:min(cuts)]
        return self.text[:len(self.text) - self._held_back()]

    def floor(self) -> int:
        """Length of the text a stop must end past (min_new_tokens: find_stop): all of it until the held tokens are
        here."""
        if self.held_tokens == 0:
            return 0
        if len(self.ids) < self.held_tokens:
            return len(self.text)
        if self._floor is None:
            self._floor = len(self._decode(self.ids[:self.held_tokens]))
        return self._floor

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
