"""Pieces shared by the OpenAI completions and chat endpoints: sampling params, response_format, SSE, fan-in of n
choices, disconnect handling, logprob formatting."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from sglang.srt.entrypoints.openai.protocol import error_body
from sglang.srt.managers.tokenizer_manager import GenerationChunk, RequestError, TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams


logger = logging.getLogger(__name__)


def log_internal_error(where: str, e: BaseException) -> tuple:
    """An unexpected failure: its traceback goes to the log under a new request id; the client gets only a generic
    message naming that id (exception text may hold paths, prompts or secrets). Returns (message, request id)."""
    request_id = uuid.uuid4().hex[:16]
    logger.error("internal server error (request id %s) on %s", request_id, where,
                 exc_info=(type(e), e, e.__traceback__))
    return f"internal server error (request id {request_id})", request_id


def sse_response(frames: AsyncIterator[str], where: str) -> StreamingResponse:
    """An SSE response: the frames, then [DONE]. A failure mid-stream becomes an error event before [DONE]: a
    RequestError's own message and status, anything else a generic 500 with a request id."""
    async def events():
        try:
            async for frame in frames:
                yield frame
        except RequestError as e:
            yield sse(error_body(e.message, e.status_code, e.param))
        except Exception as e:
            message, _ = log_internal_error(where, e)
            yield sse(error_body(message, 500))
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a seeded request with n > 1: the seed itself for choice 0 (n = 1 unchanged),
    else splitmix64 of seed + choice * golden gamma, in the signed 64-bit range seeds are validated against. So the
    choices of requests with neighbouring seeds do not repeat one another (seed + choice made seed S's second choice
    seed S + 1's first)."""
    if choice == 0:
        return seed
    z = (seed + choice * _GOLDEN_GAMMA) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z


def response_format_grammar(fmt: Optional[dict], thinking: bool) -> Optional[dict]:
    """The constraint a response_format sets (None: text or absent): json_schema -> its schema, json_object -> any
    JSON object (as OpenAI and upstream SGLang), both compact; in thinking mode the reasoning runs free up to
    </think> and the JSON follows (an EBNF grammar)."""
    from sglang.srt.constrained.xgrammar_backend import JSON_OBJECT, json_after_reasoning

    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        schema = JSON_OBJECT
    elif fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestError("response_format of type json_schema needs json_schema.schema (an object)")
        schema = json.dumps(spec["schema"])
    else:
        raise RequestError(f"response_format type must be text, json_object or json_schema, got {fmt.get('type')!r}")
    if not thinking:
        return {"json_schema": schema}
    try:
        return {"ebnf": json_after_reasoning(schema)}
    except ValueError as e:
        raise RequestError(f"response_format: {e}") from None


def sampling_params(req, max_new_tokens: int, choice: int, grammar: Optional[dict] = None) -> SamplingParams:
    """SamplingParams of choice `choice` of an OpenAI request (n > 1 with a seed: choice_seed per choice);
    `grammar`: the constraint a response_format sets, else the request's own regex / ebnf / json_schema."""
    stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
    params = SamplingParams(
        max_new_tokens=max_new_tokens, min_new_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens, no_stop_trim=req.no_stop_trim,
        seed=None if req.seed is None else choice_seed(req.seed, choice), logit_bias=req.logit_bias or None,
        **(grammar or {"regex": req.regex, "ebnf": req.ebnf, "json_schema": req.json_schema}))
    try:
        params.verify()
    except ValueError as e:
        raise RequestError(str(e)) from None
    return params


def finish_reason(reason: Optional[dict]) -> Optional[str]:
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), "abort")


def matched_stop(reason: Optional[dict]):
    return None if reason is None else reason.get("matched")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; prompt tokens served from the prefix cache in prompt_tokens_details.cached_tokens. With
    n > 1 each prompt counts once (as OpenAI and SGLang), its completion tokens in every choice."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


async def merge(streams: list) -> AsyncIterator[tuple]:
    """Interleave several async iterators, yielding (index, item); cancelling this cancels (and so aborts) all.
    The queue between them is bounded: a consumer that stops (a streaming client that does not read) stops the
    streams, so their output waits in the TokenizerManager, which cuts such a request off past its bound."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(i, stream):
        try:
            async for item in stream:
                await queue.put((i, item))
        except asyncio.CancelledError:
            raise  # the consumer is gone: nobody reads the queue
        except BaseException as e:  # re-raised in the consumer
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start_streams(streams: list) -> list:
    """Wait for every stream's first chunk, so a refused request is answered with its 4xx before a streaming
    response has started; returns streams that replay that chunk first. On failure all streams are closed
    (which aborts them in the scheduler)."""
    results = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        if isinstance(failure, StopAsyncIteration):
            raise RequestError("the request ended without output", 500)
        raise failure

    async def replay(first, stream):
        try:
            yield first
            if not first.finished:
                async for item in stream:
                    yield item
        finally:
            await stream.aclose()  # closing the replay must close (and so abort) the request too

    return [replay(first, s) for first, s in zip(results, streams)]


async def collect(streams: list, raw: Request) -> list:
    """Run every stream to its final chunk; if the client disconnects first, or one stream fails (a refused prompt of
    a batch), abort the rest (slots freed)."""
    async def run(stream) -> GenerationChunk:
        last = None
        async for last in stream:
            pass
        return last

    tasks = [asyncio.create_task(run(s)) for s in streams]
    gathered = asyncio.gather(*tasks)
    try:
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=0.5)
            if done:
                return gathered.result()
            if await raw.is_disconnected():
                raise RequestError("client disconnected", 499)
    finally:  # a failed child leaves gather done with its siblings still running: cancel each
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(gathered, *tasks, return_exceptions=True)  # their aborts done, every result retrieved


def token_text(tm: TokenizerManager, token_id: int) -> str:
    return tm.tokenizer.decode([token_id], skip_special_tokens=False) if tm.tokenizer else str(token_id)


def chat_logprobs(tm: TokenizerManager, chunk: GenerationChunk, start: int, end: int) -> dict:
    """OpenAI chat `logprobs.content` entries for output tokens [start, end)."""
    items = []
    lps = chunk.meta_info.get("output_token_logprobs", [])
    tops = chunk.meta_info.get("output_top_logprobs")
    for i in range(start, min(end, len(lps))):
        lp, tid, _ = lps[i]
        text = token_text(tm, tid)
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        entry["top_logprobs"] = [{"token": token_text(tm, t), "logprob": v,
                                  "bytes": list(token_text(tm, t).encode("utf-8"))} for v, t, _ in tops[i]] \
            if tops else []
        items.append(entry)
    return {"content": items}


def completion_logprobs(tm: TokenizerManager, chunk: GenerationChunk, start: int, end: int,
                        text_offset: int, skip_special_tokens: bool = True) -> tuple:
    """(legacy completions `logprobs` object for output tokens [start, end), the text offset after them). Every token
    is listed (special ones by name); text_offset advances by what each adds to the choice's text (nothing for a
    special token the text skips)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    lps = chunk.meta_info.get("output_token_logprobs", [])
    top = chunk.meta_info.get("output_top_logprobs")
    for i in range(start, min(end, len(lps))):
        lp, tid, _ = lps[i]
        text = token_text(tm, tid)
        tokens.append(text)
        token_lps.append(lp)
        offsets.append(text_offset)
        skipped = skip_special_tokens and tm.tokenizer is not None and text and \
            not tm.tokenizer.decode([tid], skip_special_tokens=True)
        text_offset += 0 if skipped else len(text)
        tops.append({token_text(tm, t): v for v, t, _ in top[i]} if top else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, text_offset
