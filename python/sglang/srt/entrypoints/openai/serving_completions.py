"""POST /v1/completions: prompt as a string, a list of strings, token ids or a list of token-id lists; response_format
(json_object, json_schema) as on chat, as upstream SGLang takes it."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang.srt.entrypoints.bootstrap_fields import bootstrap_infos
from sglang.srt.entrypoints.openai.protocol import COMPLETION_MAX_TOKENS, CompletionRequest
from sglang.srt.entrypoints.openai.serving_base import (
    collect, completion_logprobs, finish_reason, matched_stop, merge, new_id, now, response_format_grammar,
    sampling_params, sse, sse_response, start_streams, usage)
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager


def _prompts(tm: TokenizerManager, prompt) -> list:
    """-> list of (prompt text or None, token ids)."""
    if isinstance(prompt, str):
        return [(prompt, tm.encode(prompt))]
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(p, tm.encode(p)) for p in prompt]
    if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                       400)


async def create_completion(req: CompletionRequest, raw: Request, tm: TokenizerManager, model_name: str):
    prompts = await asyncio.to_thread(_prompts, tm, req.prompt)  # off the event loop: long prompts take seconds
    grammar = await asyncio.to_thread(response_format_grammar, req.response_format, False)
    top_n = req.logprobs or 0
    choices = []  # (prompt index, choice index) -> stream
    pairings = iter(bootstrap_infos(req, raw, len(prompts) * req.n, "prompt" if req.n == 1 else "prompt and choice"))
    for p_index, (_, ids) in enumerate(prompts):
        for c in range(req.n):
            params = sampling_params(req, COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens, c,
                                     grammar)
            choices.append(tm.generate(ids, params, return_logprob=req.logprobs is not None,
                                       top_logprobs_num=top_n, bootstrap=next(pairings)))
    rid, created = new_id("cmpl"), now()
    echo = [(text if text is not None else tm.decode(ids)) if req.echo else "" for text, ids in prompts]
    if req.stream:
        choices = await start_streams(choices)
        return sse_response(_stream(req, tm, choices, prompts, echo, rid, created, model_name),
                            "POST /v1/completions (stream)")
    finals = await collect(choices, raw)
    out_choices, completion_tokens, cached = [], 0, 0
    for i, chunk in enumerate(finals):
        p_index = i // req.n
        completion_tokens += chunk.meta_info["completion_tokens"]
        cached += chunk.meta_info.get("cached_tokens", 0) if i % req.n == 0 else 0  # each prompt counts once
        reason = chunk.meta_info["finish_reason"]
        out_choices.append({
            "index": i, "text": echo[p_index] + chunk.text,
            "logprobs": completion_logprobs(tm, chunk, 0, len(chunk.output_ids), len(echo[p_index]),
                                            req.skip_special_tokens)[0]
            if req.logprobs is not None else None,
            "finish_reason": finish_reason(reason), "matched_stop": matched_stop(reason)})
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                         "choices": out_choices, "usage": usage(prompt_tokens, completion_tokens, cached)})


async def _stream(req, tm, choices, prompts, echo, rid, created, model_name):
    sent_text = [0] * len(choices)
    sent_tokens = [0] * len(choices)
    # text_offset of each choice's next token, continued across frames so the streamed entries equal the
    # non-streaming response's (which start after the echoed prompt)
    offsets = [len(echo[i // req.n]) for i in range(len(choices))]
    completion_tokens = cached = 0
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def frame(i, text, logprobs=None, reason=None):
        return sse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish_reason(reason), "matched_stop": matched_stop(reason)}]})

    for i in range(len(choices)):
        if echo[i // req.n]:
            yield frame(i, echo[i // req.n])
    async for i, chunk in merge(choices):
        delta = chunk.text[sent_text[i]:]
        if not delta and not chunk.finished:
            # No visible text yet (a partial character, text held back for a stop string): these tokens'
            # logprobs stay pending and go out with the next frame, so every token gets exactly one entry.
            continue
        logprobs = None
        if req.logprobs is not None:
            logprobs, offsets[i] = completion_logprobs(tm, chunk, sent_tokens[i], len(chunk.output_ids),
                                                       offsets[i], req.skip_special_tokens)
        sent_text[i], sent_tokens[i] = len(chunk.text), len(chunk.output_ids)
        if chunk.finished:
            completion_tokens += chunk.meta_info["completion_tokens"]
            cached += chunk.meta_info.get("cached_tokens", 0) if i % req.n == 0 else 0
            yield frame(i, delta, logprobs, chunk.meta_info["finish_reason"])
        else:
            yield frame(i, delta, logprobs)
    if include_usage:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                   "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)})
