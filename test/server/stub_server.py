"""An aiohttp stub of our server's client-facing protocol, for the client-tool tests (test_bench_clients.py).

It speaks /v1/models (with max_model_len when `context_length` is set), /v1/completions and
/v1/chat/completions (SSE chunks, a final usage chunk with stream_options.include_usage), native /generate
(SSE chunks with the cumulative text and meta_info), and /flush_cache. It emits " the" tokens (one
DeepSeek-V4 token each, so retokenizing gives back its count) and, for the eval scripts, looks the question
up in `answers` and sends the chosen reply. It runs on a free loopback port in a background thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

from aiohttp import web

TOKEN, TOKEN_ID = " the", 270
EOS_AFTER = 3  # without ignore_eos the stub stops after this many tokens, with finish_reason "stop"


@dataclasses.dataclass
class Stub:
    answers: dict = dataclasses.field(default_factory=dict)  # question -> reply, when the prompt contains it
    fail_every: int = 0  # the n-th, 2n-th, ... generation request (1-based) gets HTTP 500
    omit_usage: bool = False  # OpenAI responses without `usage` (the client must retokenize)
    accept_length: float = 0.0  # > 0: report spec_accept_length and stream 2 tokens per /generate chunk
    context_length: int = 0  # > 0: reported as max_model_len in /v1/models (the eval scripts fit prompts to it)
    requests: int = 0
    log: list = dataclasses.field(default_factory=list)  # (path, prompt_tokens, completion_tokens) served
    bodies: list = dataclasses.field(default_factory=list)  # OpenAI request bodies served
    inflight: int = 0
    peak_inflight: int = 0
    seen: list = dataclasses.field(default_factory=list)  # text prompts served, for the reported cached tokens

    def reset(self) -> None:
        """Defaults and empty logs (the app is built once; tests share one Stub and reset it)."""
        for field in dataclasses.fields(self):
            fresh = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
            setattr(self, field.name, fresh)

    def reply(self, prompt, max_tokens: int, ignore_eos: bool) -> tuple[list, str]:
        if isinstance(prompt, str) and self.answers:
            question = max(self.answers, key=prompt.rfind)
            if prompt.rfind(question) >= 0:
                return [self.answers[question]], "stop"
        n = max_tokens if ignore_eos else min(max_tokens, EOS_AFTER)
        return [TOKEN] * n, "length" if n == max_tokens else "stop"

    def cached_tokens(self, prompt) -> int:
        """A prefix cache's report: the words of the longest earlier text prompt this one starts with."""
        if not isinstance(prompt, str):
            return 0
        hit = max((len(p.split()) for p in self.seen if prompt.startswith(p)), default=0)
        self.seen.append(prompt)
        return hit

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._openai)
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/flush_cache", self._flush_cache)
        return app

    async def _models(self, request):
        model = {"id": "stub-model", "object": "model"}
        if self.context_length:
            model["max_model_len"] = self.context_length
        return web.json_response({"object": "list", "data": [model]})

    async def _flush_cache(self, request):
        self.log.append(("/flush_cache", 0, 0))
        return web.Response(text="Cache flushed.")

    @web.middleware
    async def _count(self, request, handler):
        if request.path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
            return await handler(request)
        self.requests += 1
        if self.fail_every and self.requests % self.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            return await handler(request)
        finally:
            self.inflight -= 1

    async def _sse(self, request, payloads) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for payload in payloads:
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())
            await asyncio.sleep(0.0005)  # make TTFT and ITL measurable
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _openai(self, request):
        body = await request.json()
        chat = request.path.endswith("chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        pieces, finish = self.reply(prompt, body["max_tokens"], body.get("ignore_eos", False))
        whole = "\n".join(m["content"] for m in body["messages"]) if chat else prompt  # every message counts
        n_prompt = len(whole) if isinstance(whole, list) else len(whole.split())
        self.bodies.append(body)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(pieces), "total_tokens": n_prompt + len(pieces),
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens(whole)}}
        self.log.append((request.path, n_prompt, len(pieces)))

        def choice(text: str, done: bool, stream: bool) -> dict:
            content = ({"delta" if stream else "message": {"role": "assistant", "content": text}} if chat
                       else {"text": text})
            return {"index": 0, **content, "finish_reason": finish if done else None}

        if not body.get("stream"):
            resp = {"id": "cmpl-1", "model": body["model"], "choices": [choice("".join(pieces), True, False)]}
            return web.json_response(resp if self.omit_usage else {**resp, "usage": usage})
        chunks = [{"id": "cmpl-1", "choices": [choice(p, i == len(pieces) - 1, True)]} for i, p in enumerate(pieces)]
        if (body.get("stream_options") or {}).get("include_usage") and not self.omit_usage:
            chunks.append({"id": "cmpl-1", "choices": [], "usage": usage})
        return await self._sse(request, chunks)

    async def _generate(self, request):
        body = await request.json()
        sp = body.get("sampling_params", {})
        prompt = body.get("input_ids", body.get("text"))
        pieces, finish = self.reply(prompt, sp["max_new_tokens"], sp.get("ignore_eos", False))
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self.log.append((request.path, n_prompt, len(pieces)))
        cached = self.cached_tokens(prompt)

        def payload(i: int) -> dict:
            meta = {"id": "r1", "prompt_tokens": n_prompt, "completion_tokens": i, "e2e_latency": 0.01,
                    "cached_tokens": cached,
                    "finish_reason": {"type": finish} if i == len(pieces) else None}
            if self.accept_length:
                meta["spec_accept_length"] = self.accept_length
            return {"text": "".join(pieces[:i]), "output_ids": [TOKEN_ID] * i, "meta_info": meta}

        if not body.get("stream"):
            return web.json_response(payload(len(pieces)))
        step = 2 if self.accept_length else 1
        ends = list(range(step, len(pieces), step)) + [len(pieces)]
        return await self._sse(request, [payload(i) for i in ends])


class StubServer:
    def __init__(self) -> None:
        self.stub = Stub()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "stub server did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.stub.app(), access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
