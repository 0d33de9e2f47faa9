"""Split model output into reasoning_content and content (`--reasoning-parser deepseek-v4`).

DeepSeek-V4 never emits `<think>`: the prompt already ends with `<think>` (thinking mode) or `</think>` (chat
mode), so the server must tell the parser which one it rendered. In thinking mode the output is reasoning up to
the first `</think>` (dropped), then content. Also, in thinking mode:
  * a `<｜DSML｜tool_calls>` block that starts before any `</think>` ends the reasoning and goes to content
    (with the blank line before it) so the tool-call parser still sees it;
  * no `</think>` at all (e.g. cut by max_tokens) -> everything is reasoning, content is "".
In both modes a literal EOS string ends the output (it and anything after it are dropped), for servers that
decode without skip_special_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

EOS = "<｜end▁of▁sentence｜>"
TOOL_BLOCK_START = "<｜DSML｜tool_calls>"


@dataclass(frozen=True)
class _ThinkFormat:
    end: str  # closes the reasoning; dropped from both outputs
    handoff: tuple  # markers that end the reasoning but belong to content (earliest match wins)


_FORMATS = {
    "deepseek-v4": _ThinkFormat(end="</think>", handoff=("\n\n" + TOOL_BLOCK_START, TOOL_BLOCK_START)),
}
SUPPORTED_MODEL_TYPES = tuple(_FORMATS)


def find_first(text: str, markers: tuple) -> tuple[int, str | None]:
    """Earliest full occurrence of any marker: (position, marker), or (-1, None)."""
    best, found = -1, None
    for m in markers:
        pos = text.find(m)
        if pos >= 0 and (best < 0 or pos < best):
            best, found = pos, m
    return best, found


def partial_marker_len(text: str, markers: tuple) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker: the part a streaming
    parser must hold back because the next chunk may complete the marker."""
    longest = 0
    for m in markers:
        for k in range(min(len(text), len(m) - 1), longest, -1):
            if text.endswith(m[:k]):
                longest = k
                break
    return longest


class ReasoningParser:
    """One instance per response. `thinking` = whether the prompt ended with `<think>`.

    Streaming: feed every delta to `parse_stream_chunk`, then call `flush()` once at the end of the stream to
    release text held back as a possible partial marker. The concatenated streamed pieces equal
    `parse_non_stream` of the whole text for any split into deltas.
    """

    def __init__(self, model_type: str = "deepseek-v4", thinking: bool = False):
        if model_type not in _FORMATS:
            raise ValueError(f"unknown reasoning parser {model_type!r} (supported: {', '.join(_FORMATS)})")
        self.model_type = model_type
        self.thinking = thinking
        self._fmt = _FORMATS[model_type]
        self._in_reasoning = thinking
        self._buf = ""
        self._done = False

    def parse_non_stream(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content, content); reasoning_content is None in chat mode."""
        eos = text.find(EOS)
        if eos >= 0:
            text = text[:eos]
        if not self.thinking:
            return None, text
        pos, marker = find_first(text, (self._fmt.end,) + self._fmt.handoff)
        if marker is None:
            return text, ""
        if marker == self._fmt.end:
            return text[:pos], text[pos + len(marker):]
        return text[:pos], text[pos:]

    def parse_stream_chunk(self, delta_text: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) for one delta; either may be ""."""
        if self._done:
            return "", ""
        self._buf += delta_text
        return self._drain(final=False)

    def flush(self) -> tuple[str, str]:
        """End of stream: release anything held back. Later chunks are ignored."""
        if self._done:
            return "", ""
        out = self._drain(final=True)
        self._done = True
        return out

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while True:
            sink = reasoning if self._in_reasoning else content
            markers = ((self._fmt.end,) + self._fmt.handoff if self._in_reasoning else ()) + (EOS,)
            pos, marker = find_first(self._buf, markers)
            if marker is None:
                keep = 0 if final else partial_marker_len(self._buf, markers)
                sink.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            sink.append(self._buf[:pos])
            if marker == EOS:
                self._buf, self._done = "", True
                break
            # `</think>` is consumed; a hand-off marker stays in the buffer and becomes content.
            self._buf = self._buf[pos + len(marker):] if marker == self._fmt.end else self._buf[pos:]
            self._in_reasoning = False
        return "".join(reasoning), "".join(content)
