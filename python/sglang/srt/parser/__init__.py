"""Output parsers selected by name from the server (`--reasoning-parser`)."""

from __future__ import annotations

import functools
from typing import Callable

from sglang.srt.parser.reasoning_parser import SUPPORTED_MODEL_TYPES, ReasoningParser


def get_reasoning_parser(name: str) -> Callable[..., ReasoningParser]:
    """Factory for `--reasoning-parser NAME`: call it with `thinking=` once per response."""
    if name not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unknown reasoning parser {name!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return functools.partial(ReasoningParser, name)


__all__ = ["ReasoningParser", "get_reasoning_parser", "SUPPORTED_MODEL_TYPES"]
