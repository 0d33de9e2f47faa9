"""The HTTP server (FastAPI): OpenAI-compatible and native SGLang endpoints over the TokenizerManager.

`create_app` builds the app: lifespan (the TokenizerManager's receive loop and watchdog, a watch on the scheduler
process), the access guard (API key, admin endpoints) and error handlers; the endpoints are three route groups in
entrypoints/http_routes.py.

Every failure is answered with an OpenAI-style error body and a 4xx/5xx status; nothing a client sends can take
the process down. Request bodies are parsed by hand (entrypoints/request_body.py: JSON media type, size limit,
nesting depth, valid unicode) so every malformed body gets a 4xx naming the problem (FastAPI would answer 422).
An unexpected exception is answered with a generic 500 carrying a request id; its traceback goes to the log under
that id. Secrets never leave the server: /server_info redacts them and keys are compared in constant time. Who may
call which endpoint (API key, admin key, loopback) is entrypoints/access.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang.srt.entrypoints.access import AccessPolicy
from sglang.srt.entrypoints.http_routes import health_routes, native_routes, openai_routes
from sglang.srt.entrypoints.openai.protocol import error_body
from sglang.srt.entrypoints.openai.response_store import ResponseStore
from sglang.srt.entrypoints.openai.serving_base import log_internal_error
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def _error(message: str, status: int, param: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def _internal_error(raw: Request, e: BaseException) -> JSONResponse:
    """A generic 500 (exception text may hold paths, prompts or secrets); the traceback goes to the log under
    the request id the client is given."""
    message, request_id = log_internal_error(f"{raw.method} {raw.url.path}", e)
    return _error(message, 500, headers={"X-Request-Id": request_id})


class ApiKeyGuard:
    """The access checks (entrypoints/access.py: API key, admin endpoints) before any body is read, and the
    last-resort 500, as a plain ASGI middleware: Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) hides a
    client's disconnect from the endpoint, so a non-streaming request would run to max_tokens after its client
    left."""

    def __init__(self, app, access: AccessPolicy) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = Request(scope, receive)
        refused = self.access.refusal(scope)
        if refused is not None:
            await _error(refused.message, refused.status_code)(scope, receive, send)
            return
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:  # answered here: past this middleware Starlette would log it without the id
            if started:  # a response (a stream) is under way: nothing else can be sent
                raise
            await _internal_error(raw, e)(scope, receive, send)


def create_app(tm: TokenizerManager, args: ServerArgs, metrics=None, scheduler_proc=None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tm.start()
        watch = None
        if scheduler_proc is not None:
            async def watch_scheduler():
                why = await tm.watch_process(scheduler_proc)  # every request failed with a 503 naming it
                if args.tp_size > 1:  # the other ranks cannot go on without it: stop them and the server
                    scheduler_proc.kill()
                    app.state.fatal_error = why
                    server = getattr(app.state, "uvicorn_server", None)
                    if server is not None:  # uvicorn's graceful shutdown; launch_server then exits with 1
                        server.should_exit = True
                    else:
                        os.kill(os.getpid(), signal.SIGTERM)

            watch = asyncio.get_running_loop().create_task(watch_scheduler())
        yield
        if watch is not None:
            watch.cancel()
        await responses.stop_all()  # background responses still generating: aborted, not left pending

    responses = ResponseStore(admit=lambda: tm.check_queue())  # a background request is refused as any other
    app = FastAPI(title="sglang (DeepSeek-V4)", lifespan=lifespan)
    app.state.fatal_error = None
    app.state.responses = responses
    app.state.max_request_body_bytes = int(args.max_request_body_mb * 2**20)
    app.state.disaggregation_mode = args.disaggregation_mode  # which requests need the router's bootstrap fields

    access = AccessPolicy.from_args(args)
    app.add_middleware(ApiKeyGuard, access=access)

    @app.exception_handler(RequestError)
    async def on_request_error(raw: Request, e: RequestError):
        return _error(e.message, e.status_code, e.param, headers=e.headers)  # a 429's Retry-After

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(raw: Request, e: StarletteHTTPException):  # unknown path (404), wrong method (405)
        return _error(f"{e.detail}: {raw.method} {raw.url.path}", e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def on_error(raw: Request, e: Exception):
        return _internal_error(raw, e)

    app.include_router(health_routes(tm, args, metrics, scheduler_proc))
    app.include_router(native_routes(tm, access))
    app.include_router(openai_routes(tm, args, responses, access))
    return app
