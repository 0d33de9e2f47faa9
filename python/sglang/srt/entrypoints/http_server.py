"""The HTTP server (FastAPI): OpenAI-compatible and native SGLang endpoints over the TokenizerManager.

Every failure is answered with an OpenAI-style error body and a 4xx/5xx status; nothing a client sends can take
the process down. Request bodies are parsed by hand (entrypoints/request_body.py: JSON media type, size limit,
nesting depth, valid unicode) so every malformed body gets a 4xx naming the problem (FastAPI would answer 422).
An unexpected exception is answered with a generic 500 carrying a request id; its traceback goes to the log under
that id. Secrets never leave the server: /server_info redacts them and API keys are compared in constant time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest, TokenizeRequest, error_body)
from sglang.srt.entrypoints.openai.serving_base import SSE_DONE, sse, start_streams
from sglang.srt.entrypoints.request_body import read_json
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager, input_logprobs_entries
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)
HEALTH_PROBE_TIMEOUT_S = 5.0  # /health's own one-token probe while the scheduler's steps are failing


# Server args never returned by /server_info in clear: keys, tokens, passwords (not e.g. max_total_tokens).
_SECRET_ARG = re.compile(r"(^|_)(key|secret|password|passwd|token|credentials?)$")


def _error(message: str, status: int, param: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def _internal_error(raw: Request, e: BaseException) -> JSONResponse:
    """A generic 500 (exception text may hold paths, prompts or secrets); the traceback goes to the log under
    the request id the client is given."""
    request_id = uuid.uuid4().hex[:16]
    logger.error("internal server error (request id %s) on %s %s", request_id, raw.method, raw.url.path,
                 exc_info=(type(e), e, e.__traceback__))
    return _error(f"internal server error (request id {request_id})", 500, headers={"X-Request-Id": request_id})


def redact_secrets(args: dict) -> dict:
    return {k: ("***" if v is not None and _SECRET_ARG.search(k) else v) for k, v in args.items()}


def _key_ok(raw: Request, api_key: str) -> bool:
    """Constant-time comparison, so response timing does not reveal how much of a guessed key is right."""
    sent = raw.headers.get("authorization", "").encode("latin-1")  # the header's bytes as received
    return hmac.compare_digest(sent, f"Bearer {api_key}".encode("utf-8"))


async def _parse(raw: Request, model: type) -> BaseModel:
    body = await read_json(raw, raw.app.state.max_request_body_bytes)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"]) or "body"
        raise RequestError(f"invalid field '{field}': {first['msg']}"
                           + (f" ({len(e.errors()) - 1} more problems)" if len(e.errors()) > 1 else ""),
                           param=field) from None


def create_app(tm: TokenizerManager, args: ServerArgs, metrics=None, scheduler_proc=None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tm.start()
        watch = None
        if scheduler_proc is not None:
            async def watchdog():
                while scheduler_proc.is_alive():
                    await asyncio.sleep(1.0)
                logger.error("the scheduler process died (exit code %s)", scheduler_proc.exitcode)
                tm.fail_all(f"the scheduler process died (exit code {scheduler_proc.exitcode}); restart the server")

            watch = asyncio.get_running_loop().create_task(watchdog())
        yield
        if watch is not None:
            watch.cancel()

    app = FastAPI(title="sglang (DeepSeek-V4)", lifespan=lifespan)
    app.state.max_request_body_bytes = int(args.max_request_body_mb * 2**20)
    served_name = args.served_model_name or args.model_path
    model_names = {served_name, args.model_path}

    def check_model(name: str) -> None:
        if name not in model_names:
            raise RequestError(f"the model '{name}' does not exist; this server serves '{served_name}'", 404)

    @app.middleware("http")
    async def api_key_guard(raw: Request, call_next):
        if args.api_key and raw.url.path != "/health" and not _key_ok(raw, args.api_key):
            return _error("missing or invalid API key (send 'Authorization: Bearer <key>')", 401)
        try:
            return await call_next(raw)
        except Exception as e:  # answered here: past this middleware Starlette would log it without the id
            return _internal_error(raw, e)

    @app.exception_handler(RequestError)
    async def on_request_error(raw: Request, e: RequestError):
        return _error(e.message, e.status_code, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(raw: Request, e: StarletteHTTPException):  # unknown path (404), wrong method (405)
        return _error(f"{e.detail}: {raw.method} {raw.url.path}", e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def on_error(raw: Request, e: Exception):
        return _internal_error(raw, e)

    # ---- health and info --------------------------------------------------------------------------------------
    def scheduler_dead() -> Optional[str]:
        if tm.dead_reason:
            return tm.dead_reason
        if scheduler_proc is not None and not scheduler_proc.is_alive():  # before the watchdog's next look
            return f"the scheduler process died (exit code {scheduler_proc.exitcode})"
        return None

    def steps_failing() -> Optional[str]:
        stats = tm.last_stats
        if stats is not None and not stats.healthy:
            return f"the scheduler's last {stats.consecutive_failed_steps} steps failed"
        return None

    async def generate_one_token(timeout: float) -> Optional[str]:
        """One greedy token through the scheduler: None when it came back, else why not."""
        params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        try:
            async def one():
                async for _ in tm.generate([tm.ready.eos_token_ids[0] if tm.ready.eos_token_ids else 0], params):
                    pass
            await asyncio.wait_for(one(), timeout=timeout)
        except (RequestError, asyncio.TimeoutError) as e:
            return str(e) or "timed out"
        return None

    probe_lock = asyncio.Lock()  # one recovery probe at a time, however many /health calls wait on it

    @app.get("/health")
    async def health():
        """For load balancers: 503 while the scheduler cannot serve: its process died, or its latest steps all
        failed. In the second case (only) /health runs one token itself, so a server whose failures have passed
        comes back to 200 even when no traffic is routed to it."""
        if steps_failing() and not scheduler_dead():
            async with probe_lock:
                if steps_failing():
                    await generate_one_token(timeout=HEALTH_PROBE_TIMEOUT_S)
        down = scheduler_dead() or steps_failing()
        return Response(status_code=503 if down else 200, content=down)

    @app.get("/health_generate")
    async def health_generate():
        """The end-to-end probe: one token through the scheduler."""
        failure = scheduler_dead() or await generate_one_token(timeout=60)
        if failure:
            return _error(f"generation health check failed: {failure}", 503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path or tm.ready.model_path,
                "served_model_name": served_name, "is_generation": True, "context_length": tm.ready.context_length,
                "vocab_size": tm.ready.vocab_size}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        from sglang import __version__

        stats = tm.last_stats.__dict__ if tm.last_stats else None
        return {**redact_secrets(tm.ready.effective_args), "version": __version__,
                "max_total_num_tokens": tm.ready.max_total_tokens, "pool_report": tm.ready.pool_report,
                "scheduler_stats": stats}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        await tm.flush_cache()
        return PlainTextResponse("Cache flushed (no prefix cache is enabled, nothing was cached)\n")

    @app.get("/metrics")
    async def get_metrics():
        if metrics is None:
            raise RequestError("metrics are off; start the server with --enable-metrics", 404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        req = await _parse(raw, TokenizeRequest)
        if isinstance(req.prompt, str):
            ids = await asyncio.to_thread(tm.encode, req.prompt)
            return {"tokens": ids, "count": len(ids), "max_model_len": tm.ready.context_length}
        ids = await asyncio.to_thread(lambda: [tm.encode(p) for p in req.prompt])
        return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": tm.ready.context_length}

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        req = await _parse(raw, DetokenizeRequest)
        return {"text": tm.decode(req.tokens)}

    # ---- OpenAI-compatible --------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "sglang", "root": args.model_path,
                                            "max_model_len": tm.ready.context_length}]}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        from sglang.srt.entrypoints.openai.serving_completions import create_completion

        req = await _parse(raw, CompletionRequest)
        check_model(req.model)
        return await create_completion(req, raw, tm, served_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        from sglang.srt.entrypoints.openai.serving_chat import create_chat_completion

        req = await _parse(raw, ChatCompletionRequest)
        check_model(req.model)
        return await create_chat_completion(req, raw, tm, served_name, args)

    # ---- native -------------------------------------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(raw: Request):
        req = await _parse(raw, GenerateRequest)
        return await native_generate(req, raw, tm)

    return app


async def native_generate(req: GenerateRequest, raw: Request, tm: TokenizerManager):
    from sglang.srt.entrypoints.openai.serving_base import collect

    if (req.text is None) == (req.input_ids is None):
        raise RequestError("give exactly one of 'text' or 'input_ids'")
    single = isinstance(req.text, str) or (req.input_ids is not None and all(isinstance(t, int) for t in req.input_ids))
    prompts = [req.text] if isinstance(req.text, str) else req.text
    ids_list = ([req.input_ids] if single else req.input_ids) if req.input_ids is not None \
        else await asyncio.to_thread(lambda: [tm.encode(t) for t in prompts])  # off the event loop: can take seconds
    n = len(ids_list)
    if n == 0:
        raise RequestError("the batch is empty")
    sp = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params] * n
    if len(sp) != n:
        raise RequestError(f"sampling_params has {len(sp)} entries for {n} prompts")
    try:
        params = [SamplingParams.from_dict(p) for p in sp]
    except (ValueError, TypeError) as e:
        raise RequestError(str(e)) from None
    streams = [tm.generate(ids, p, return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                           top_logprobs_num=req.top_logprobs_num) for ids, p in zip(ids_list, params)]

    def shape(i, chunk) -> dict:
        meta = dict(chunk.meta_info)
        by_pos = meta.pop("input_token_logprobs_by_position", None)
        if req.return_logprob:
            meta["input_token_logprobs"] = input_logprobs_entries(ids_list[i], by_pos, req.logprob_start_len)
        out = {"text": chunk.text, "output_ids": chunk.output_ids, "meta_info": meta}
        if not single:
            out["index"] = i
        return out

    if req.stream:
        from sglang.srt.entrypoints.openai.serving_base import merge

        streams = await start_streams(streams)

        async def events():
            try:
                async for i, chunk in merge(streams):
                    yield sse(shape(i, chunk))
            except RequestError as e:
                yield sse({"error": {"message": e.message, "code": e.status_code}})
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")
    finals = await collect(streams, raw)
    outs = [shape(i, c) for i, c in enumerate(finals)]
    return outs[0] if single else outs
