"""Incremental detokenization with stop-string hold-back (runs in the HTTP process).

Decoding token by token breaks multi-byte characters, so each step decodes a short window of recent tokens and
only extends the text once the window no longer ends in a partial character (U+FFFD). While a request runs, text
that could be the start of one of its stop strings is held back, so a stop string is never emitted, even in part;
once the scheduler reports the matched stop string, the text is cut before it (a matched stop token is not shown
either). With min_new_tokens, a stop that the tokens before the min_new_tokens-th complete is plain text. A stop_regex
match is cut as soon as it is complete, but the start of a match cannot be held back (what a pattern will match is not
known in advance), so a stream may already have shown its first characters.

This runs on the HTTP process's event loop, so the work per chunk is bounded by the chunk, never by the output so
far: stops are searched for only where one could end in the new text (a stop string in its last len(stop) - 1
characters before it and the new ones; a stop_regex, like the scheduler, in the text of the last STOP_REGEX_WINDOW
tokens, from the window of the first new token on: one linear RE2 search per pattern), and the held-back prefix of a
stop string is updated from the previous one (amortized O(new characters x len(stop)) per stop).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from sglang.srt.managers.output_shaping import trim_stop, trim_stop_token
from sglang.srt.sampling.sampling_params import STOP_REGEX_WINDOW, compile_stop_regex, find_stop, search_stop_regex


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
        self._searched = 0  # length of the text searched for stops: one not found yet ends past it
        self._searched_tokens = 0  # tokens of that text
        self._cut: Optional[int] = None  # start of the first stop found in the text (the running text ends there)
        self._settled = deque([(0, 0)])  # (tokens, text length) where the text grew: where stop_regex windows start
        self._prefixes = [0] * len(self.stop)  # per stop: the longest suffix of the text that is a proper prefix of it
        self._prefixes_at = 0  # length of the text they describe

    def _decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list) -> None:
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self.stop_regex:
                self._settled.append((self.read_offset, len(self.text)))

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
            self._search_new_text()
            if self._cut is not None:
                return self.text[:self._cut]
        return self.text[:len(self.text) - self._held_back()]

    def _search_new_text(self) -> None:
        """Find the stops that end in the text added since the last search (past the floor). The first stop of the
        whole text is the earliest one found so far: each search finds the first stop ending in its new text."""
        if len(self.text) == self._searched or len(self.ids) < self.held_tokens:
            return  # nothing new, or every stop so far is plain text (the floor is the whole text)
        floor = self.floor()
        start = max(self._searched, floor)
        cuts = [i for i in (find_stop(self.text, stop, start) for stop in self.stop) if i >= 0]
        if self.stop_regex:  # the scheduler searched the window after each new token: their union
            base = self._text_before(max(self._searched_tokens, self.held_tokens) + 1 - STOP_REGEX_WINDOW)
            tail = self.text[base:]
            cuts += [base + m.start() for m in (search_stop_regex(r, tail, floor - base) for r in self.stop_regex)
                     if m is not None]
        self._searched, self._searched_tokens = len(self.text), self.read_offset
        if cuts:
            self._cut = min(cuts if self._cut is None else [self._cut, *cuts])

    def _text_before(self, token: int) -> int:
        """Length of the text of the tokens before `token`, rounded down to where the text grew (a character that
        spans tokens starts with the first of them); earlier positions are forgotten (`token` never decreases)."""
        while len(self._settled) > 1 and self._settled[1][0] <= token:
            self._settled.popleft()
        return self._settled[0][1]

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
        """Length of the longest suffix of the text that is a proper prefix of some stop string. Per stop, it is at
        most the previous one plus the characters added since: each length tried beyond the answer lowers that
        bound, so the lengths tried add up to the text's length plus the number of calls."""
        added, self._prefixes_at = len(self.text) - self._prefixes_at, len(self.text)
        for i, stop in enumerate(self.stop):
            n = min(len(stop) - 1, len(self.text), self._prefixes[i] + added)
            while n > 0 and not self.text.endswith(stop[:n]):
                n -= 1
            self._prefixes[i] = n
        return max(self._prefixes, default=0)
