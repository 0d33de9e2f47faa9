"""POST /v1/responses (OpenAI's Responses API, as upstream SGLang serves it), GET / DELETE /v1/responses/{id}.

A Responses request is turned into a chat request (input items -> messages, instructions -> a system message,
function tools -> chat tools, reasoning.effort -> thinking mode with that effort, text.format -> response_format,
max_output_tokens -> max_tokens) and generated like /v1/chat/completions (plan_chat: the same encoding, checks,
parsers and grammars). The answer is a `response` object whose output items are a reasoning item (with
--reasoning-parser), a message with output_text, and function_call items (with --tool-call-parser); streamed, the
Responses events (response.created ... response.output_text.delta ... response.completed). Stored responses (store,
the default) and background ones (answered at once or streamed, polled or streamed again by GET, stopped by cancel):
response_store.py (each seen only with the API key that created it).
"""

from __future__ import annotations

import json
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest
from sglang.srt.entrypoints.openai.response_store import EventLog, ResponseStore
from sglang.srt.entrypoints.openai.serving_base import (
    collect, finish_reason, log_internal_error, new_id, now, sampling_params, sse, sse_response, start_streams)
from sglang.srt.entrypoints.openai.serving_chat import chat_parsers, plan_chat, text_deltas, tools_json
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager

_TEXT_PARTS = ("input_text", "output_text", "text")
# Responses fields that are not chat fields; anything else extra (top_k, stop, seed, ...) passes to the chat request
# chat fields a response has no place for, with the values that ask for nothing
_UNSERVED = {"top_logprobs": (None, 0), "logprobs": (None, False), "n": (None, 1)}
_OWN = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "parallel_tool_calls", "reasoning",
        "text", "store", "previous_response_id", "metadata", "background", "truncation", "stream"}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of text parts", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{where}: only text content parts are supported, got {kind!r}", param="input")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}: a {part['type']} part needs a string text", param="input")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items) -> list:
    """Responses input (a string, or message / function_call / function_call_output / reasoning items) -> chat
    messages. Consecutive function calls join one assistant message, as a chat history holds them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise RequestError("input: give a string or at least one item", param="input")
    messages, reasoning = [], None
    for n, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{n}]"
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}: role must be user, system, developer or assistant", param="input")
            message = {"role": item["role"], "content": _text(item.get("content", ""), where)}
            if item["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise RequestError(f"{where}: a reasoning item's content (or summary) is a list of parts with a "
                                   f"string text", param="input")
            reasoning = "".join(p["text"] for p in parts)
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise RequestError(f"{where}: a function_call needs string call_id, name and arguments", param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and ("tool_calls" in last or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}: a function_call_output needs a string call_id", param="input")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise RequestError(f"{where}: input items of type {kind!r} are not supported", param="input")
    return messages


def _chat_tools(tools: Optional[list]) -> Optional[list]:
    if not tools:
        return None
    out = []
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(f"tools[{n}]: only function tools are supported, got {kind!r}", param="tools")
        spec = tool["function"] if isinstance(tool.get("function"), dict) else tool  # the chat form is taken too
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise RequestError(f"tools[{n}]: a function tool needs a non-empty string name", param="tools")
        out.append({"type": "function", "function": {k: spec[k] for k in ("name", "description", "parameters")
                                                      if k in spec}})
    return out


def _tool_choice(choice):
    """Responses' tool_choice (auto / none / required, or {"type": "function", "name"}) in the chat form."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name", (choice.get("function") or {}).get("name"))
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise RequestError('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                       param="tool_choice")


def chat_request(req: ResponsesRequest, history: list) -> ChatCompletionRequest:
    """The chat request that generates this response (after `history`, a stored conversation's messages)."""
    if req.background and not req.store:
        raise RequestError("a background response is kept to be polled: background needs store=true", param="store")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    messages += input_messages(req.input)
    extra = req.model_extra or {}
    for name, inert in _UNSERVED.items():
        if extra.get(name) not in inert:
            raise RequestError(f"{name} is not supported on /v1/responses", param=name)
    body = {k: v for k, v in req.model_dump().items() if k not in _OWN and v is not None}
    body.update(messages=messages, tools=_chat_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
                parallel_tool_calls=req.parallel_tool_calls, max_tokens=req.max_output_tokens)
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:  # a reasoning request thinks (effort "none": chat mode)
        body["reasoning_effort"] = effort
        kwargs = body.get("chat_template_kwargs", {})
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        body["chat_template_kwargs"] = {"thinking": effort != "none", **kwargs}  # the client's own setting wins
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif fmt is not None:
        body["response_format"] = fmt
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        raise RequestError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def _usage(prompt: int, chunk, reasoning_tokens: int) -> dict:
    completion = chunk.meta_info["completion_tokens"]
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": chunk.meta_info.get("cached_tokens", 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion}


def _reasoning_tokens(tm: TokenizerManager, chunk, thinking: bool) -> int:
    """Output tokens up to and with </think> (all of them while it has not come)."""
    end = tm.tokenizer.token_to_id("</think>") if thinking and tm.tokenizer is not None else None
    if end is None:
        return 0
    ids = chunk.output_ids
    return ids.index(end) + 1 if end in ids else len(ids)


class ResponseBuilder:
    """The response object of one generation, its output items grown as the text comes (streamed or at once)."""

    def __init__(self, req: ResponsesRequest, model_name: str, previous: Optional[str]) -> None:
        self.req, self.items, self.text = req, [], {}
        self.response = {
            "id": new_id("resp"), "object": "response", "created_at": now(), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": req.instructions, "model": model_name,
            "output": self.items, "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": previous,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "reasoning": req.reasoning, "text": req.text or {"format": {"type": "text"}}, "tools": req.tools or [],
            "tool_choice": req.tool_choice, "store": req.store, "truncation": req.truncation,
            "metadata": req.metadata or {}, "user": req.user, "background": req.background, "usage": None}

    def add(self, delta: dict) -> list:
        """Apply one chat delta ({"reasoning_content"}, {"content"} or {"tool_calls": [...]}) to the output items;
        returns the Responses events it makes (without sequence numbers)."""
        events = []
        if "reasoning_content" in delta:
            events += self._text_item("reasoning", delta["reasoning_content"])
        elif "content" in delta:
            events += self._text_item("message", delta["content"])
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a new call
                events += self._close_open()
                item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
                self.items.append(item)
                events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                               "item": dict(item)})
            item = self.items[-1]
            piece = call["function"].get("arguments", "")
            if piece:
                item["arguments"] += piece
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": len(self.items) - 1, "delta": piece})
        return events

    def _text_item(self, kind: str, piece: str) -> list:
        events = []
        last = self.items[-1] if self.items else None
        if last is None or last["type"] != kind or last.get("status") == "completed":
            events += self._close_open()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": []}
            self.items.append(item)
            events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": json.loads(json.dumps(item))})
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)})
        item = self.items[-1]
        item["content"][0]["text"] += piece
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        events.append({"type": f"response.{name}.delta", "item_id": item["id"], "output_index": len(self.items) - 1,
                       "content_index": 0, "delta": piece})
        return events

    def _close_open(self) -> list:
        """Complete the last item if it is still open; its .done events."""
        if not self.items or self.items[-1].get("status") == "completed":
            return []
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        if item["type"] == "function_call":
            return [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                     "arguments": item["arguments"]},
                    {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]
        part = item["content"][0]
        name = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        return [{"type": f"response.{name}.done", "item_id": item["id"], "output_index": index, "content_index": 0,
                 "text": part["text"]},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index, "item": json.loads(json.dumps(item))}]

    def finish(self, chunk, prompt_tokens: int, reasoning_tokens: int) -> list:
        """The last chunk: close the open item, set status and usage; the events that makes."""
        events = self._close_open()
        reason = finish_reason(chunk.meta_info["finish_reason"])
        self.response["status"] = {"length": "incomplete", "abort": "cancelled"}.get(reason, "completed")
        if reason == "length":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.response["usage"] = _usage(prompt_tokens, chunk, reasoning_tokens)
        return events

    def fail(self, message: str, status_code: int) -> None:
        """A background response whose generation failed: status failed, the error OpenAI's way."""
        self._close_open()
        self.response["status"] = "failed"
        self.response["error"] = {"code": "invalid_prompt" if status_code < 500 else "server_error",
                                  "message": message}

    def assistant_messages(self) -> list:
        """The output as chat messages (what a response continued by previous_response_id said)."""
        message = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return [message]


async def create_response(req: ResponsesRequest, raw: Request, tm: TokenizerManager, model_name: str, args,
                          store: ResponseStore, owner: Optional[str] = None):
    """`owner`: who stores the response and may continue from previous_response_id (access.AccessPolicy.owner)."""
    history = store.history(req.previous_response_id, owner) if req.previous_response_id else []
    chat = chat_request(req, history)
    plan = await plan_chat(chat, tm, args)
    stream = tm.generate(plan.ids, sampling_params(chat, plan.max_new, 0, plan.grammar))
    parser, tools = chat_parsers(chat, args, plan.thinking), tools_json(chat)
    builder = ResponseBuilder(req, model_name, req.previous_response_id)
    # what a continuation starts from: the conversation without this request's instructions (not carried over)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages][1 if req.instructions else 0:]

    def done(chunk) -> list:
        events = builder.finish(chunk, len(plan.ids), _reasoning_tokens(tm, chunk, plan.thinking))
        if req.store:
            store.put(builder.response, messages + builder.assistant_messages(), owner)
        return events

    if req.background:
        log = EventLog() if req.stream else None  # kept, so a stream can be (re)joined at any event

        async def generate_in_background():
            try:
                if log is not None:
                    await log.append(_snapshot("response.created", builder.response))
                    await log.append(_snapshot("response.queued", builder.response))
                async for event in _generation_events(stream, builder, parser, tools, done):
                    if builder.response["status"] == "queued":  # the first chunk has come
                        builder.response["status"] = "in_progress"
                        if log is not None:
                            await log.append(_snapshot("response.in_progress", builder.response))
                    if log is not None and event is not None:
                        await log.append(event)
            except RequestError as e:
                builder.fail(e.message, e.status_code)
            except Exception as e:  # noqa: BLE001 - the response records the failure, the server goes on
                builder.fail(log_internal_error("POST /v1/responses (background)", e)[0], 500)
            finally:
                await stream.aclose()
                if log is not None:
                    if builder.response["status"] == "failed":
                        await log.append(_snapshot("response.failed", builder.response))
                    await log.close()

        store.start(builder.response, messages, generate_in_background, log, owner)
        if log is not None:
            return sse_response(log.frames(-1), "POST /v1/responses (background stream)")
        return JSONResponse(json.loads(json.dumps(builder.response)))
    if not req.stream:
        (chunk,) = await collect([stream], raw)
        for delta in text_deltas(parser, chunk.text, True, tools):
            builder.add(delta)
        done(chunk)
        return JSONResponse(builder.response)
    (stream,) = await start_streams([stream])

    async def frames():
        seq = 0
        for kind in ("response.created", "response.in_progress"):
            yield sse({**_snapshot(kind, builder.response), "sequence_number": seq})
            seq += 1
        async for event in _generation_events(stream, builder, parser, tools, done):
            if event is not None:
                yield sse({**event, "sequence_number": seq})
                seq += 1

    return sse_response(frames(), "POST /v1/responses (stream)")


def _snapshot(kind: str, response: dict) -> dict:
    """An event carrying the response as it is now (it keeps changing afterwards)."""
    return {"type": kind, "response": json.loads(json.dumps(response))}


async def _generation_events(stream, builder: ResponseBuilder, parser, tools, done):
    """The Responses events of a generation as its chunks come (without sequence numbers; a None as each chunk
    arrives, before its events, so a caller sees the first one), ending with response.completed /
    response.incomplete / response.failed."""
    sent = 0
    async for chunk in stream:
        new_text, sent = chunk.text[sent:], len(chunk.text)
        yield None
        for delta in text_deltas(parser, new_text, chunk.finished, tools):
            for e in builder.add(delta):
                yield e
        if chunk.finished:
            for e in done(chunk):
                yield e
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                builder.response["status"], "response.failed")
            yield _snapshot(kind, builder.response)
