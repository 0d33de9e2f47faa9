"""POST /v1/chat/completions: DeepSeek-V4 message encoding, reasoning split and DSML tool calls, streaming or not.

Thinking vs chat mode comes from `chat_template_kwargs.thinking` (or SGLANG_DEFAULT_THINKING) and
`reasoning_effort`; with `--reasoning-parser deepseek-v4` the reasoning goes to `reasoning_content`; with
`--tool-call-parser deepseekv4` and request tools, DSML blocks become OpenAI `tool_calls`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang.srt.constrained.tool_call_grammar import tool_call_ebnf
from sglang.srt.entrypoints.bootstrap_fields import bootstrap_infos
from sglang.srt.entrypoints.openai.encoding_dsv4 import encode_messages, resolve_thinking
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_base import (
    chat_logprobs, collect, finish_reason, matched_stop, merge, new_id, now, response_format_grammar, sampling_params,
    sse, sse_response, start_streams, usage)
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager


@dataclass
class ChoiceParsers:
    """Per-choice output parsers (they hold streaming state)."""

    reasoning: Optional[object] = None
    tools: Optional[object] = None
    tool_ids: dict = field(default_factory=dict)  # tool-call index -> id
    num_calls: int = 0
    max_calls: Optional[int] = None  # parallel_tool_calls false: 1 (calls after the first are dropped)


def _prompt(req: ChatCompletionRequest) -> tuple:
    """-> (prompt text, thinking mode)."""
    try:
        thinking, effort = resolve_thinking(req.chat_template_kwargs, req.reasoning_effort)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        # tool_choice "none": the tools leave the prompt too (as upstream), so the model is not invited to call one
        offered = req.tools if req.tool_choice != "none" else None
        tools = [t.model_dump(exclude_none=True) for t in offered] if offered else None
        return encode_messages(messages, tools=tools, thinking=thinking, reasoning_effort=effort,
                               response_format=req.response_format), thinking
    except ValueError as e:
        raise RequestError(str(e)) from None


def _tokenize(req: ChatCompletionRequest, tm: TokenizerManager) -> tuple:
    """-> (prompt token ids, thinking mode). Run in a worker thread: encoding a long chat takes seconds."""
    prompt, thinking = _prompt(req)
    return tm.encode(prompt), thinking


def chat_parsers(req: ChatCompletionRequest, args, thinking: bool) -> ChoiceParsers:
    from sglang.srt.function_call import get_tool_call_parser
    from sglang.srt.parser import get_reasoning_parser

    p = ChoiceParsers()
    if args.reasoning_parser and req.separate_reasoning:
        p.reasoning = get_reasoning_parser(args.reasoning_parser)(thinking=thinking)
    if args.tool_call_parser and req.tools and req.tool_choice != "none":
        p.tools = get_tool_call_parser(args.tool_call_parser)()
        p.max_calls = None if req.parallel_tool_calls else 1
    return p


_NOT_FORCED = object()


def _forced_tool(req: ChatCompletionRequest, args):
    """tool_choice -> _NOT_FORCED (auto / none), None ("required": any tool) or the named function's name."""
    choice = req.tool_choice
    if choice in ("auto", "none", None):
        return _NOT_FORCED
    if choice == "required":
        name = None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            (choice.get("function") or {}).get("name"), str):
        name = choice["function"]["name"]
    else:
        raise RequestError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                           '{"name": ...}}')
    if not req.tools:
        raise RequestError("tool_choice forces a tool call but the request has no tools")
    if not args.tool_call_parser:
        raise RequestError("a forced tool_choice needs the server started with --tool-call-parser deepseekv4")
    return name


def _constraint(req: ChatCompletionRequest, thinking: bool, forced) -> Optional[dict]:
    """The grammar a forced tool call (which wins) or a response_format sets, or None."""
    if forced is _NOT_FORCED:
        return response_format_grammar(req.response_format, thinking)
    try:
        return {"ebnf": tool_call_ebnf(tools_json(req), forced, thinking)}
    except ValueError as e:
        raise RequestError(f"tool_choice: {e}") from None


def tools_json(req: ChatCompletionRequest) -> Optional[list]:
    return [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None


def _check_tools(req: ChatCompletionRequest, args) -> None:
    """Tools whose calls will be parsed have schemas the parser can apply: a 400 now, not a failure mid-answer."""
    from sglang.srt.function_call.deepseekv4_detector import validate_tools

    if args.tool_call_parser and req.tools and req.tool_choice != "none":
        try:
            validate_tools(tools_json(req))
        except ValueError as e:
            raise RequestError(str(e), param="tools") from None


@dataclass
class ChatPlan:
    """A chat request made ready to generate: its prompt, mode, output budget and constraint."""

    ids: list
    thinking: bool
    max_new: int
    grammar: Optional[dict]


async def plan_chat(req: ChatCompletionRequest, tm: TokenizerManager, args) -> ChatPlan:
    """Check the tools and tool_choice, encode the conversation (in a worker thread) and pick max_new_tokens and the
    grammar; RequestError for what the client got wrong. Shared with /v1/responses."""
    _check_tools(req, args)
    forced = _forced_tool(req, args)
    ids, thinking = await asyncio.to_thread(_tokenize, req, tm)
    max_new = req.max_completion_tokens or req.max_tokens
    if max_new is None and len(ids) >= tm.ready.context_length:  # no max_tokens: say what is too long
        raise RequestError(f"the prompt ({len(ids)} tokens) leaves no room in the context length "
                           f"{tm.ready.context_length} for an answer; shorten the conversation")
    max_new = max_new or max(1, tm.ready.context_length - len(ids))
    grammar = await asyncio.to_thread(_constraint, req, thinking, forced)
    return ChatPlan(ids, thinking, max_new, grammar)


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, tm: TokenizerManager, model_name: str,
                                 args):
    plan = await plan_chat(req, tm, args)
    ids, thinking, max_new, grammar = plan.ids, plan.thinking, plan.max_new, plan.grammar
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    pairings = bootstrap_infos(req, raw, req.n, "choice")
    streams = [tm.generate(ids, sampling_params(req, max_new, c, grammar), return_logprob=req.logprobs,
                           top_logprobs_num=top_n, bootstrap=pairings[c]) for c in range(req.n)]
    parsers = [chat_parsers(req, args, thinking) for _ in range(req.n)]
    rid, created = new_id("chatcmpl"), now()
    if req.stream:
        streams = await start_streams(streams)
        return sse_response(_stream(req, tm, streams, parsers, len(ids), rid, created, model_name),
                            "POST /v1/chat/completions (stream)")
    finals = await collect(streams, raw)
    choices, completion_tokens, cached = [], 0, 0
    for i, (chunk, p) in enumerate(zip(finals, parsers)):
        completion_tokens += chunk.meta_info["completion_tokens"]
        cached += chunk.meta_info.get("cached_tokens", 0) if i == 0 else 0  # the prompt counts once (see usage)
        reasoning, content = (p.reasoning.parse_non_stream(chunk.text) if p.reasoning else (None, chunk.text))
        message = {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": None}
        reason = finish_reason(chunk.meta_info["finish_reason"])
        if p.tools is not None:
            normal, calls = p.tools.detect_and_parse(content, tools_json(req))
            calls = calls[:p.max_calls]
            # as streamed: a rejected call's DSML stays in the content, its block's tags do not
            message["content"] = (normal or None) if calls else normal
            if calls:
                message["tool_calls"] = [{"id": new_id("call"), "type": "function", "index": c.index,
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
        choices.append({"index": i, "message": message, "finish_reason": reason,
                        "matched_stop": matched_stop(chunk.meta_info["finish_reason"]),
                        "logprobs": chat_logprobs(tm, chunk, 0, len(chunk.output_ids)) if req.logprobs else None})
        if req.return_meta_info:
            choices[-1]["meta_info"] = chunk.meta_info
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                         "choices": choices, "usage": usage(len(ids), completion_tokens, cached)})


def text_deltas(p: ChoiceParsers, text: str, final: bool, tools: Optional[list]) -> list:
    """Turn new output text into OpenAI delta dicts through the reasoning and tool-call parsers."""
    out = []
    if p.reasoning is not None:
        r, content = p.reasoning.parse_stream_chunk(text)
        if final:
            r2, c2 = p.reasoning.flush()
            r, content = r + r2, content + c2
        if r:
            out.append({"reasoning_content": r})
    else:
        content = text
    if p.tools is not None:
        result = p.tools.parse_streaming_increment(content, tools)
        calls = list(result.calls)
        normal = result.normal_text
        if final:
            tail = p.tools.flush(tools)
            normal += tail.normal_text
            calls += tail.calls
        if normal:
            out.append({"content": normal})
        for c in calls:
            if p.max_calls is not None and c.index >= p.max_calls:
                continue
            entry = {"index": c.index, "function": {"arguments": c.arguments}}
            if c.name is not None:
                p.tool_ids[c.index] = new_id("call")
                entry.update(id=p.tool_ids[c.index], type="function")
                entry["function"]["name"] = c.name
                p.num_calls += 1
            out.append({"tool_calls": [entry]})
    elif content:
        out.append({"content": content})
    return out


async def _stream(req, tm, streams, parsers, prompt_tokens, rid, created, model_name):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent_text = [0] * len(streams)
    sent_tokens = [0] * len(streams)
    completion_tokens = cached = 0
    tools = tools_json(req)

    def frame(i, delta, reason=None, logprobs=None, matched=None):
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                                 "matched_stop": matched}]})

    for i in range(len(streams)):
        yield frame(i, {"role": "assistant", "content": ""})
    async for i, chunk in merge(streams):
        new_text = chunk.text[sent_text[i]:]
        logprobs = chat_logprobs(tm, chunk, sent_tokens[i], len(chunk.output_ids)) if req.logprobs else None
        sent_text[i], sent_tokens[i] = len(chunk.text), len(chunk.output_ids)
        deltas = text_deltas(parsers[i], new_text, chunk.finished, tools)
        for j, delta in enumerate(deltas):
            yield frame(i, delta, logprobs=logprobs if j == 0 else None)
        if not deltas and logprobs and logprobs["content"]:
            yield frame(i, {}, logprobs=logprobs)
        if chunk.finished:
            completion_tokens += chunk.meta_info["completion_tokens"]
            cached += chunk.meta_info.get("cached_tokens", 0) if i == 0 else 0
            reason = finish_reason(chunk.meta_info["finish_reason"])
            if parsers[i].num_calls and reason == "stop":
                reason = "tool_calls"
            yield frame(i, {}, reason, matched=matched_stop(chunk.meta_info["finish_reason"]))
    if include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                   "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)})
