"""A failure in the middle of a streamed response ends it with an error event, then [DONE]: a RequestError with its
own status and message, anything else with a generic 500 naming a request id (the traceback is logged under it)."""

from __future__ import annotations

import asyncio
import json
import logging

from sglang.srt.entrypoints.openai.serving_base import SSE_DONE, sse, sse_response
from sglang.srt.managers.tokenizer_manager import RequestError


def body_of(frames) -> list:
    async def read():
        return [chunk async for chunk in sse_response(frames, "POST /test (stream)").body_iterator]

    return asyncio.run(read())


async def failing(error: BaseException):
    yield sse({"n": 1})
    raise error


def test_unexpected_failure_mid_stream_is_a_generic_500_event(caplog):
    with caplog.at_level(logging.ERROR):
        events = body_of(failing(RuntimeError("secret path /srv/x")))
    assert events[0] == sse({"n": 1}) and events[-1] == SSE_DONE and len(events) == 3
    error = json.loads(events[1].removeprefix("data: "))
    assert error["code"] == 500 and error["error"]["code"] == 500
    assert "request id" in error["message"] and "secret" not in error["message"]
    request_id = error["message"].rsplit(" ", 1)[-1].rstrip(")")
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info and "secret path" in str(logged[0].exc_info[1])


def test_request_error_mid_stream_keeps_its_status():
    events = body_of(failing(RequestError("request aborted", 499)))
    error = json.loads(events[1].removeprefix("data: "))
    assert (error["code"], error["message"], events[-1]) == (499, "request aborted", SSE_DONE)


def test_a_stream_that_ends_normally_gets_done_only():
    async def fine():
        yield sse({"n": 1})

    assert body_of(fine()) == [sse({"n": 1}), SSE_DONE]
