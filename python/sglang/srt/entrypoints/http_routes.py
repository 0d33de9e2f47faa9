"""The HTTP server's endpoints in three groups, each an APIRouter over the TokenizerManager; `create_app`
(http_server.py) includes them:

* health_routes: /health, /health_generate, /model_info, /server_info, /get_load, /flush_cache,
  /clear_hicache_storage_backend, /metrics
* openai_routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (stored ones: their creator's key's)
* native_routes: SGLang's /generate, /abort_request, /tokenize, /detokenize, and the admin endpoints: weight update
  and inspection, profiling, expert distribution records

A handler raises RequestError for anything the client got wrong; the app answers it with an OpenAI-style error body.
Who may call which endpoint is entrypoints/access.py (the app's guard checks it before a handler runs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from sglang.srt.entrypoints.access import AccessPolicy
from sglang.srt.entrypoints.bootstrap_fields import bootstrap_infos, refuse_in_pd_mode
from sglang.srt.entrypoints.openai.protocol import (
    AbortRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest,
    GetWeightsByNameRequest, ProfileRequest, ResponsesRequest, TokenizeRequest, UpdateWeightsFromDiskRequest)
from sglang.srt.entrypoints.openai.response_store import ResponseStore
from sglang.srt.entrypoints.openai.serving_base import (
    choice_seed, collect, merge, sse, sse_response, start_streams)
from sglang.srt.entrypoints.request_body import parse_request
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.version import __version__

HEALTH_PROBE_TIMEOUT_S = 5.0  # /health's own one-token probe while the scheduler's steps are failing

# Server args never returned by /server_info in clear: keys, tokens, passwords (not e.g. max_total_tokens).
_SECRET_ARG = re.compile(r"(^|_)(key|secret|password|passwd|token|credentials?)$")


def redact_secrets(args: dict) -> dict:
    return {k: ("***" if v is not None and _SECRET_ARG.search(k) else v) for k, v in args.items()}


def served_model_name(args: ServerArgs) -> str:
    return args.served_model_name or args.model_path


# ---- health and info ----------------------------------------------------------------------------------------
def health_routes(tm: TokenizerManager, args: ServerArgs, metrics=None, scheduler_proc=None) -> APIRouter:
    router = APIRouter()

    def scheduler_dead() -> Optional[str]:
        """Why nothing can be served: the scheduler process died, the receive loop failed, or the watchdog found the
        scheduler stuck (until it completes a step again)."""
        if tm.unavailable():
            return tm.unavailable()
        if scheduler_proc is not None and not scheduler_proc.is_alive():  # before the watchdog's next look
            return scheduler_proc.describe_exit()
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

    @router.get("/health")
    async def health():
        """For load balancers: 503 while the scheduler cannot serve: its process died, the HTTP side stopped
        receiving from it, it completed no step for --watchdog-timeout while requests awaited it (until it does), or
        its latest steps all failed. In the last case (only) /health runs one token itself, so a server whose failures
        have passed comes back to 200 even when no traffic is routed to it."""
        if steps_failing() and not scheduler_dead():
            async with probe_lock:
                if steps_failing():
                    await generate_one_token(timeout=HEALTH_PROBE_TIMEOUT_S)
        down = scheduler_dead() or steps_failing()
        return Response(status_code=503 if down else 200, content=down)

    @router.get("/health_generate")
    async def health_generate():
        """The end-to-end probe: one token through the scheduler."""
        failure = scheduler_dead() or await generate_one_token(timeout=60)
        if failure:
            raise RequestError(f"generation health check failed: {failure}", 503)
        return Response(status_code=200)

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info():
        return {"model_path": tm.weights_path or args.model_path,  # after /update_weights_from_disk: its path
                "tokenizer_path": args.tokenizer_path or tm.ready.model_path,
                "served_model_name": served_model_name(args), "is_generation": True,
                "context_length": tm.ready.context_length, "vocab_size": tm.ready.vocab_size}

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info():
        stats = tm.last_stats.__dict__ if tm.last_stats else None
        # upstream SGLang's shape: one entry per data-parallel scheduler (its bench_serving reads the accept length)
        state = {"token_usage": stats["token_usage"] if stats else 0.0}
        if stats and stats["spec_accept_length"] is not None:
            state["avg_spec_accept_length"] = stats["spec_accept_length"]
        return {**redact_secrets(tm.ready.effective_args), "version": __version__,
                "max_total_num_tokens": tm.ready.max_total_tokens, "pool_report": tm.ready.pool_report,
                "warmup_forwards": tm.ready.warmup_forwards,
                "scheduler_stats": stats, "internal_states": [state]}

    @router.get("/get_load")
    async def get_load():
        """Upstream SGLang's load report, one entry per data-parallel scheduler: sglang-router polls it (its
        power_of_two policy and /get_loads); num_tokens is the KV cache in use, in tokens."""
        groups = sorted(tm.group_stats.values(), key=lambda g: g.dp_rank) or [tm.last_stats]
        return [{"dp_rank": g.dp_rank, "num_reqs": g.num_running_reqs + g.num_waiting_reqs,
                 "num_waiting_reqs": g.num_waiting_reqs,
                 "num_tokens": round(g.token_usage * tm.ready.max_total_tokens)} for g in groups if g is not None]

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if tm.states:  # the scheduler refuses too: a running request may be reading a cached prefix
            raise RequestError(f"cannot flush the cache while {len(tm.states)} request(s) are running; retry when "
                               f"the server is idle", 400)
        await tm.flush_cache()  # waits for the scheduler's answer: a 400 when it still runs requests
        if args.disable_radix_cache:
            return PlainTextResponse("Cache flushed (the prefix cache is disabled: nothing was cached)\n")
        return PlainTextResponse("Cache flushed\n")

    @router.api_route("/clear_hicache_storage_backend", methods=["GET", "POST"])
    async def clear_hicache_storage_backend():
        """Upstream's route: delete the storage tier's files (the device and host tiers keep what they hold, as
        /flush_cache leaves the files)."""
        await tm.clear_hicache_storage()  # a 400 when there is none (or it is off since a weight update)
        return PlainTextResponse("Hierarchical cache storage backend cleared.\n")

    @router.get("/metrics")
    async def get_metrics():
        if metrics is None:
            raise RequestError("metrics are off; start the server with --enable-metrics", 404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return router


# ---- OpenAI-compatible --------------------------------------------------------------------------------------
def openai_routes(tm: TokenizerManager, args: ServerArgs, stored: ResponseStore, access: AccessPolicy) -> APIRouter:
    """`stored`: the ResponseStore of /v1/responses (the app stops its background responses at shutdown); a stored
    response is seen only with the key that created it (`access.owner`)."""
    router = APIRouter()
    served_name = served_model_name(args)
    model_names = {served_name, args.model_path}

    def check_model(name: str) -> None:
        if name not in model_names:
            raise RequestError(f"the model '{name}' does not exist; this server serves '{served_name}'", 404)

    def model_card() -> dict:
        return {"id": served_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": args.model_path, "max_model_len": tm.ready.context_length}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):  # OpenAI's models.retrieve; the served name or the model path
        check_model(model)
        return model_card()

    @router.post("/v1/completions")
    async def completions(raw: Request):
        from sglang.srt.entrypoints.openai.serving_completions import create_completion

        req = await parse_request(raw, CompletionRequest)
        check_model(req.model)
        return await create_completion(req, raw, tm, served_name)

    @router.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        from sglang.srt.entrypoints.openai.serving_chat import create_chat_completion

        req = await parse_request(raw, ChatCompletionRequest)
        check_model(req.model)
        return await create_chat_completion(req, raw, tm, served_name, args)

    @router.post("/v1/responses")
    async def responses(raw: Request):
        from sglang.srt.entrypoints.openai.serving_responses import create_response

        req = await parse_request(raw, ResponsesRequest)
        check_model(req.model)
        refuse_in_pd_mode(raw, "/v1/responses")
        return await create_response(req, raw, tm, served_name, args, stored, owner=access.owner(raw.scope))

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw: Request):
        query, owner = raw.query_params, access.owner(raw.scope)
        if query.get("stream", "false").lower() not in ("true", "1"):
            return stored.get(response_id, owner).response
        after = query.get("starting_after")
        if after is not None and not after.isdigit():
            raise RequestError("starting_after must be an event's sequence number (0 or more)", param="starting_after")
        frames = stored.stream(response_id, -1 if after is None else int(after), owner)  # 4xx before it starts
        return sse_response(frames, "GET /v1/responses/{id} (stream)")

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request):
        await stored.delete(response_id, access.owner(raw.scope))  # 404 when unknown; a running one is stopped
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, raw: Request):
        return await stored.cancel(response_id, access.owner(raw.scope))

    return router


# ---- native -------------------------------------------------------------------------------------------------
def native_routes(tm: TokenizerManager, access: AccessPolicy) -> APIRouter:
    router = APIRouter()

    @router.api_route("/generate", methods=["POST", "PUT"])
    async def generate(raw: Request):
        req = await parse_request(raw, GenerateRequest)
        return await native_generate(req, raw, tm)

    @router.post("/abort_request")
    async def abort_request(raw: Request):
        """Abort a request by the rid its /generate gave (with its samples), or every request (abort_all); they end
        with finish_reason abort and the output so far. An rid that is not running (finished) aborts nothing.
        abort_all ends every client's requests: an admin action."""
        req = await parse_request(raw, AbortRequest)
        if not req.abort_all and not req.rid:
            raise RequestError("give the 'rid' of a request, or 'abort_all': true", param="rid")
        if req.abort_all:
            access.require_admin(raw.scope)
        return {"aborted": await tm.abort_matching(req.rid, req.abort_all)}

    @router.post("/tokenize")
    async def tokenize(raw: Request):
        req = await parse_request(raw, TokenizeRequest)
        if isinstance(req.prompt, str):
            ids = await asyncio.to_thread(tm.encode, req.prompt)
            return {"tokens": ids, "count": len(ids), "max_model_len": tm.ready.context_length}
        ids = await asyncio.to_thread(lambda: [tm.encode(p) for p in req.prompt])
        return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": tm.ready.context_length}

    @router.post("/detokenize")
    async def detokenize(raw: Request):
        req = await parse_request(raw, DetokenizeRequest)
        return {"text": tm.decode(req.tokens)}

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(raw: Request):
        """Load another checkpoint of the served model in place (upstream's answer: success, message,
        num_paused_requests); a refusal (another architecture or format, a missing tensor) is a 400 with
        success false and the served weights unchanged, as is a model_path outside --weights-dir (access.py)."""
        req = await parse_request(raw, UpdateWeightsFromDiskRequest)
        try:
            path = access.checkpoint_path(req.model_path, tm.ready.model_path)
            message = await tm.update_weights_from_disk(path, req.abort_all_requests)
        except RequestError as e:
            return JSONResponse({"success": False, "message": e.message, "num_paused_requests": 0},
                                status_code=e.status_code)
        return {"success": True, "message": message, "num_paused_requests": 0}

    @router.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(raw: Request):
        """The first truncate_size rows (at most MAX_WEIGHT_ROWS) of a served weight, by its checkpoint name (float32
        nested lists, as upstream; to check a weight update). The scheduler sends a tensor; the lists and their JSON
        are made in a worker thread, off the scheduler's loop and the event loop."""
        req = await parse_request(raw, GetWeightsByNameRequest)
        rows = await tm.get_weights_by_name(req.name, req.truncate_size)
        body = await asyncio.to_thread(lambda: json.dumps(rows.tolist()).encode())
        return Response(body, media_type="application/json")

    for action in ("start", "stop", "dump"):  # upstream's expert distribution endpoints (eplb/expert_distribution.py)
        async def expert_distribution(action=action):
            return PlainTextResponse(await tm.expert_distribution(action) + "\n")

        router.add_api_route(f"/{action}_expert_distribution_record", expert_distribution, methods=["GET", "POST"])

    @router.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(raw: Request):
        """torch.profiler on every scheduler rank until /stop_profile or for num_steps steps (as upstream)."""
        from sglang.srt.managers.scheduler_profiler import ProfileConfig, confined_output_dir

        req = await parse_request(raw, ProfileRequest, empty_ok=True)
        try:
            output_dir = confined_output_dir(req.output_dir)
        except ValueError as e:
            raise RequestError(str(e), param="output_dir") from None
        try:
            config = ProfileConfig.make(output_dir, req.activities, req.num_steps, req.with_stack,
                                        req.record_shapes, req.profile_prefix or req.profile_id)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return PlainTextResponse(await tm.profile(True, config) + "\n")

    @router.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile():
        """Stop the profile and write each rank's trace (this can take a while for a long GPU profile)."""
        return PlainTextResponse(await tm.profile(False) + "\n")

    return router


MAX_SAMPLES = 16  # `n` of one request, as for chat


def _num_samples(sampling_params: list) -> int:
    """`n` of /generate's sampling_params (the same for every prompt of a batch), validated."""
    values = {(p or {}).get("n") for p in sampling_params}
    values = {1 if v is None else v for v in values}
    if len(values) > 1:
        raise RequestError("sampling parameter 'n' must be the same for every prompt of a batch", param="n")
    n = values.pop()
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
        raise RequestError(f"sampling parameter 'n' must be an integer in [1, {MAX_SAMPLES}], got {n!r}"[:200],
                           param="n")
    return n


MAX_RID_CHARS = 256


def _client_rids(rid, n: int, single: bool) -> list:
    """The client's request ids, one per prompt (None each when it gave none): a string for one prompt, a list of
    distinct strings for a batch; they become meta_info.id and what /abort_request takes."""
    if rid is None:
        return [None] * n
    rids = [rid] if single and isinstance(rid, str) else rid
    if single != isinstance(rid, str) or not isinstance(rids, list) or len(rids) != n:  # ["a"] for one prompt too
        raise RequestError(f"rid must be {'a string' if single else f'a list of {n} strings, one per prompt'}",
                           param="rid")
    if any(not 0 < len(r) <= MAX_RID_CHARS for r in rids) or len(set(rids)) != n:
        raise RequestError(f"rid must hold distinct, non-empty strings of at most {MAX_RID_CHARS} characters",
                           param="rid")
    return rids


async def native_generate(req: GenerateRequest, raw: Request, tm: TokenizerManager):
    """/generate: one prompt (text or token ids) or a batch; SGLang's output dicts, streamed as SSE or not."""
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
    samples = _num_samples(sp)
    try:
        params = [SamplingParams.from_dict({k: v for k, v in (p or {}).items() if k != "n"}) for p in sp]
    except (ValueError, TypeError) as e:
        raise RequestError(str(e), param=getattr(e, "param", None)) from None  # SamplingParamError names its field
    rids = _client_rids(req.rid, n, single)
    groups = [None] * n
    if samples > 1:  # upstream's parallel sampling: every prompt `n` times, prompt by prompt, as a list
        ids_list = [ids for ids in ids_list for _ in range(samples)]
        groups = [r for r in rids for _ in range(samples)]  # /abort_request with the prompt's rid aborts them all
        rids = [None if r is None else f"{r}-{c}" for r in rids for c in range(samples)]
        # a seeded prompt's sample c draws with choice_seed(seed, c) (as the OpenAI endpoints'), not n equal samples
        params = [p if p.seed is None else dataclasses.replace(p, seed=choice_seed(p.seed, c))
                  for p in params for c in range(samples)]
        single = False
    pairings = bootstrap_infos(req, raw, len(ids_list), "prompt" if samples == 1 else "prompt and sample")
    streams = [tm.generate(ids, p, return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                           top_logprobs_num=req.top_logprobs_num, rid=rid, group=group, client_gone=raw.is_disconnected,
                           bootstrap=pairing)
               for ids, p, rid, group, pairing in zip(ids_list, params, rids, groups, pairings)]

    def shape(i, chunk) -> dict:
        return chunk.to_dict() if single else {**chunk.to_dict(), "index": i}

    if req.stream:
        streams = await start_streams(streams)

        async def frames():
            async for i, chunk in merge(streams):
                yield sse(shape(i, chunk))

        return sse_response(frames(), "POST /generate (stream)")
    finals = await collect(streams, raw)
    outs = [shape(i, c) for i, c in enumerate(finals)]
    return outs[0] if single else outs
