"""Tool-call parsers selected by name from the server (`--tool-call-parser`)."""

from __future__ import annotations

from sglang.srt.function_call.deepseekv4_detector import (DeepSeekV4Detector, StreamingParseResult, ToolCallDelta,
                                                          ToolCallError, ToolCallItem, validate_tools)

_PARSERS = {"deepseekv4": DeepSeekV4Detector}


def get_tool_call_parser(name: str) -> type[DeepSeekV4Detector]:
    """Detector class for `--tool-call-parser NAME`; instantiate one per response (it holds streaming state)."""
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (supported: {', '.join(_PARSERS)})")
    return _PARSERS[name]


__all__ = ["DeepSeekV4Detector", "StreamingParseResult", "ToolCallDelta", "ToolCallError", "ToolCallItem",
           "get_tool_call_parser", "validate_tools"]
