"""Online serving benchmark: send a dataset of prompts to a running server and report throughput and latency.

    python -m sglang.bench_serving --backend sglang --dataset-name random --random-input-len 8192 \\
        --random-output-len 1024 --random-range-ratio 1.0 --num-prompts 512 --max-concurrency 64
    python -m sglang.bench_serving --backend openai --dataset-name sharegpt --dataset-path sharegpt.json

Without --dataset-name the dataset is `random` (prompts of random token ids from the tokenizer, offline), or
`sharegpt` when --dataset-path is given; the datasets are in bench_serving_datasets.py. `multi-turn` sends each
conversation's turns one after the other, every turn with the whole conversation before it:

    python -m sglang.bench_serving --backend sglang-oai-chat --dataset-name multi-turn --mt-num-sessions 32 \
        --mt-turns 4 --mt-first-len 2048 --mt-turn-len 128 --mt-output-len 128

The prompt tokens the server reused from its prefix cache (meta_info.cached_tokens or
usage.prompt_tokens_details.cached_tokens) are summed and reported as the prompt-token cache hit rate.

Backends: `sglang` streams the native /generate, `openai` (alias `sglang-oai`) streams /v1/completions,
`openai-chat` (alias `sglang-oai-chat`) streams /v1/chat/completions. Requests arrive all at once
(`--request-rate inf`) or as a Poisson process, capped by `--max-concurrency`. Python callers use
`run_benchmark(parse_args([...]))`, which returns a BenchResult.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import time
from typing import Awaitable, Callable, Optional

import aiohttp
import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from sglang.bench_serving_datasets import DatasetRow, add_dataset_args, get_dataset
from sglang.srt.environ import envs
from sglang.utils_openai_client import (add_server_args, fetch_model_id, iter_sse, load_tokenizer,
                                        raise_for_status, server_root)

# ---- requests ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestSpec:
    """What every request of a run shares."""
    root: str
    model: str
    stream: bool
    ignore_eos: bool
    extra_body: dict
    send_max_tokens: bool = True  # False (--omit-max-tokens): no max_tokens; the client stops reading at output_len


@dataclasses.dataclass
class RequestOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0  # the server's count when it reports one, else the dataset's
    output_len: int = 0  # the server's count when it reports one, else retokenized
    output_len_reported: bool = False
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list = dataclasses.field(default_factory=list)  # seconds between tokens after the first
    chunks: list = dataclasses.field(default_factory=list)  # (perf_counter time, tokens) per arrival
    tokens_seen: int = 0  # sum of the chunks' tokens, kept as we go (summing per chunk is quadratic)
    accept_length: Optional[float] = None  # speculative decoding, from meta_info
    cached_tokens: int = 0  # prompt tokens the server reused from its prefix cache
    finish_reason: Optional[str] = None
    error: str = ""

    def on_tokens(self, start: float, new_tokens: int) -> None:
        """Record `new_tokens` arriving now; a chunk of several tokens spreads its gap evenly over them."""
        now = time.perf_counter()
        if not self.chunks:
            self.ttft = now - start
        else:
            self.itl.extend([(now - self.chunks[-1][0]) / new_tokens] * new_tokens)
        self.chunks.append((now, new_tokens))
        self.tokens_seen += new_tokens


def _merge(body: dict, extra: dict) -> dict:
    """--extra-request-body merged into the body; nested dicts (sampling_params) merge one level deep."""
    out = dict(body)
    for key, value in extra.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


async def _payloads(resp: aiohttp.ClientResponse, stream: bool):
    if stream:
        async for payload in iter_sse(resp):
            yield payload
    else:
        yield await resp.json(content_type=None)  # do not insist on the Content-Type header


async def request_generate(session: aiohttp.ClientSession, spec: RequestSpec, row: DatasetRow) -> RequestOutput:
    """Native /generate: each chunk holds the cumulative text and meta_info.completion_tokens so far."""
    sampling = {"max_new_tokens": row.output_len, "temperature": 0.0, "ignore_eos": spec.ignore_eos}
    if not spec.send_max_tokens:
        del sampling["max_new_tokens"]
    body = {"input_ids" if isinstance(row.prompt, list) else "text": row.prompt,
            "sampling_params": sampling, "stream": spec.stream}
    out, start, meta = RequestOutput(prompt_len=row.prompt_len), time.perf_counter(), {}
    async with session.post(f"{spec.root}/generate", json=_merge(body, spec.extra_body)) as resp:
        await raise_for_status(resp)
        async for data in _payloads(resp, spec.stream):
            meta = data.get("meta_info") or {}
            count = meta.get("completion_tokens", out.tokens_seen + 1)  # no count: one token per chunk
            if count > out.tokens_seen:
                out.on_tokens(start, count - out.tokens_seen)
            out.generated_text = data.get("text", out.generated_text)
            if _answer_read(spec, row, out, resp):
                break
    out.latency = time.perf_counter() - start
    out.prompt_len = meta.get("prompt_tokens", row.prompt_len)
    out.output_len_reported = "completion_tokens" in meta
    out.output_len = meta.get("completion_tokens", 0)
    out.accept_length = meta.get("spec_accept_length", meta.get("accept_length"))
    out.cached_tokens = meta.get("cached_tokens") or 0
    reason = meta.get("finish_reason")
    if out.finish_reason is None:  # not stopped by the client (--omit-max-tokens)
        out.finish_reason = reason.get("type") if isinstance(reason, dict) else reason  # SGLang sends {"type": ...}
    return out


def _answer_read(spec: RequestSpec, row: DatasetRow, out: RequestOutput, resp: aiohttp.ClientResponse) -> bool:
    """--omit-max-tokens: once output_len tokens arrived the answer counts as ended; the connection is closed, so the
    server aborts the request and frees its slots (as if the model had stopped there)."""
    if spec.send_max_tokens or out.tokens_seen < row.output_len:
        return False
    out.finish_reason = "client_stop"
    resp.close()
    return True


def _choice_text(choice: dict) -> str:
    if "text" in choice:  # /v1/completions
        return choice["text"] or ""
    part = choice.get("delta") or choice.get("message") or {}  # chat: stream / non-stream
    return (part.get("reasoning_content") or "") + (part.get("content") or "")


async def request_openai(session: aiohttp.ClientSession, spec: RequestSpec, row: DatasetRow,
                         chat: bool = False) -> RequestOutput:
    """/v1/completions or /v1/chat/completions; each content chunk counts as one arrival, the token total
    comes from the final `usage` chunk (stream_options.include_usage)."""
    messages = isinstance(row.prompt, list) and bool(row.prompt) and isinstance(row.prompt[0], dict)
    if isinstance(row.prompt, list) and chat != messages:
        raise ValueError("the chat backend needs text prompts or messages; random-ids sends token ids"
                         if chat else "chat messages need a chat backend")
    body = {"model": spec.model, "max_tokens": row.output_len, "temperature": 0.0, "stream": spec.stream,
            "ignore_eos": spec.ignore_eos}
    if not spec.send_max_tokens:
        del body["max_tokens"]
    if chat:
        body["messages"] = row.prompt if messages else [{"role": "user", "content": row.prompt}]
    else:
        body["prompt"] = row.prompt
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    out, start, usage, texts = RequestOutput(prompt_len=row.prompt_len), time.perf_counter(), {}, []
    async with session.post(spec.root + path, json=_merge(body, spec.extra_body)) as resp:
        await raise_for_status(resp)
        async for data in _payloads(resp, spec.stream):
            usage = data.get("usage") or usage
            for choice in (data.get("choices") or [])[:1]:
                text = _choice_text(choice)
                if text:
                    out.on_tokens(start, 1)
                    texts.append(text)
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if data.get("meta_info"):  # SGLang may attach meta_info (spec accept length) to OpenAI chunks
                out.accept_length = data["meta_info"].get("spec_accept_length", out.accept_length)
            if _answer_read(spec, row, out, resp):
                break
    out.latency = time.perf_counter() - start
    out.generated_text = "".join(texts)
    out.prompt_len = usage.get("prompt_tokens", row.prompt_len)
    out.output_len_reported = "completion_tokens" in usage
    out.output_len = usage.get("completion_tokens", 0)
    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return out


async def request_chat(session: aiohttp.ClientSession, spec: RequestSpec, row: DatasetRow) -> RequestOutput:
    return await request_openai(session, spec, row, chat=True)


RequestFn = Callable[[aiohttp.ClientSession, RequestSpec, DatasetRow], Awaitable[RequestOutput]]
BACKENDS: dict[str, RequestFn] = {
    "sglang": request_generate,  # native /generate
    "openai": request_openai, "sglang-oai": request_openai,  # /v1/completions
    "openai-chat": request_chat, "sglang-oai-chat": request_chat,  # /v1/chat/completions
}


async def send(fn: RequestFn, session: aiohttp.ClientSession, spec: RequestSpec, row: DatasetRow,
               tok: Tokenizer) -> RequestOutput:
    """One request, never raising: failures come back with success False and the error text."""
    start = time.perf_counter()
    try:
        out = await fn(session, spec, row)
    except Exception as e:  # noqa: BLE001 - a benchmark counts failures and keeps going
        return RequestOutput(prompt_len=row.prompt_len, latency=time.perf_counter() - start,
                             error=f"{type(e).__name__}: {e}")
    if not spec.stream:  # the whole answer arrives at once: the first token comes with the last
        out.ttft = out.latency
    if not out.output_len_reported:
        out.output_len = len(tok.encode(out.generated_text, add_special_tokens=False).ids)
    extra = out.output_len - out.tokens_seen
    if extra > 0 and out.chunks:  # chunks undercounted (e.g. OpenAI chunks of several tokens): credit the last
        out.chunks[-1] = (out.chunks[-1][0], out.chunks[-1][1] + extra)
    out.success = True
    return out


# ---- the run ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Concurrency:
    now: int = 0
    peak: int = 0


def _conversations(rows: list[DatasetRow]) -> list[list[DatasetRow]]:
    """Rows grouped into what arrives together: each multi-turn session's turns (in order), every other row alone."""
    groups, by_session = [], {}
    for row in rows:
        if row.session is None:
            groups.append([row])
        elif row.session in by_session:
            by_session[row.session].append(row)
        else:
            by_session[row.session] = [row]
            groups.append(by_session[row.session])
    return groups


def _with_history(row: DatasetRow, history: Optional[tuple], chat: bool, tok: Tokenizer) -> DatasetRow:
    """A turn as sent: after the conversation so far (`history`: the previous turn as sent and its answer), as chat
    messages or as one text."""
    if history is None:
        return row
    prev, answer = history
    if chat:
        before = prev.prompt if isinstance(prev.prompt, list) else [{"role": "user", "content": prev.prompt}]
        prompt = before + [{"role": "assistant", "content": answer}, {"role": "user", "content": row.prompt}]
        n = sum(len(e.ids) for e in tok.encode_batch([m["content"] for m in prompt], add_special_tokens=False))
    else:
        prompt = f"{prev.prompt}{answer}\n\n{row.prompt}"
        n = len(tok.encode(prompt, add_special_tokens=False).ids)
    return dataclasses.replace(row, prompt=prompt, prompt_len=n)


async def _arrivals(rows: list, rate: float, seed: int):
    """Yield rows all at once (rate inf) or with exponential gaps (a Poisson process of `rate` req/s)."""
    rng = np.random.default_rng(seed)
    for i, row in enumerate(rows):
        yield row
        if not math.isinf(rate) and i + 1 < len(rows):
            await asyncio.sleep(rng.exponential(1.0 / rate))


async def _warmup(args: argparse.Namespace, fn: RequestFn, session: aiohttp.ClientSession, spec: RequestSpec,
                  row: DatasetRow, tok: Tokenizer) -> None:
    # Short outputs: a warmup only needs to reach every code path (compile, graph capture), not decode long.
    row = dataclasses.replace(row, output_len=min(row.output_len, 16))
    outs = await asyncio.gather(*(send(fn, session, spec, row, tok) for _ in range(args.warmup_requests)))
    if not any(o.success for o in outs):
        raise RuntimeError(f"warmup failed, is the server up? First error: {outs[0].error}")


async def _benchmark(args: argparse.Namespace, rows: list[DatasetRow], tok: Tokenizer):
    fn, root = BACKENDS[args.backend], server_root(args)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)  # long generations must not be cut by the client
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model
        if model is None:
            try:
                model = await fetch_model_id(session, root)
            except Exception as e:  # noqa: BLE001 - /generate needs no model name
                print(f"GET /v1/models failed ({type(e).__name__}: {e}); sending model='default'")
                model = "default"
        spec = RequestSpec(root, model, not args.disable_stream, not args.disable_ignore_eos,
                           json.loads(args.extra_request_body) if args.extra_request_body else {},
                           send_max_tokens=not args.omit_max_tokens)
        if args.warmup_requests > 0 and rows:
            await _warmup(args, fn, session, spec, rows[0], tok)
        if args.flush_cache:
            async with session.post(f"{root}/flush_cache") as resp:
                await resp.read()
        if args.profile:
            await _profile_call(session, f"{root}/start_profile", _profile_body(args))
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
        level, pbar = _Concurrency(), tqdm(total=len(rows), disable=args.disable_tqdm)

        async def one(row: DatasetRow) -> RequestOutput:
            async with sem:
                level.now += 1
                level.peak = max(level.peak, level.now)
                try:
                    return await send(fn, session, spec, row, tok)
                finally:
                    level.now -= 1
                    pbar.update(1)

        chat = fn is request_chat

        async def conversation(turns: list) -> list:
            """A row alone, or a multi-turn session's turns one after the other, each after the previous answer
            with the conversation so far; a failed turn fails the ones after it (they need its answer)."""
            outs, history = [], None
            for row in turns:
                if outs and not outs[-1].success:
                    outs.append(RequestOutput(prompt_len=row.prompt_len, error="an earlier turn of the "
                                              "conversation failed"))
                    pbar.update(1)
                    continue
                row = _with_history(row, history, chat, tok)
                outs.append(await one(row))
                history = (row, outs[-1].generated_text)
            return outs

        start, tasks = time.perf_counter(), []
        async for turns in _arrivals(_conversations(rows), args.request_rate, args.seed):
            tasks.append(asyncio.create_task(conversation(turns)))
        outputs = [out for outs in await asyncio.gather(*tasks) for out in outs]
        duration = time.perf_counter() - start
        pbar.close()
        if args.profile and not args.profile_num_steps:  # a profile of num_steps stopped by itself
            await _profile_call(session, f"{root}/stop_profile", None)
    return list(outputs), duration, level.peak, start


def _profile_body(args: argparse.Namespace) -> dict:
    """/start_profile's body: as upstream, the client's SGLANG_TORCH_PROFILER_DIR (when set) names the directory."""
    body = {"activities": args.profile_activities, "num_steps": args.profile_num_steps,
            "profile_prefix": args.profile_prefix}
    if envs.SGLANG_TORCH_PROFILER_DIR.is_set():
        body["output_dir"] = envs.SGLANG_TORCH_PROFILER_DIR.get()
    return {k: v for k, v in body.items() if v is not None}


async def _profile_call(session: aiohttp.ClientSession, url: str, body: Optional[dict]) -> None:
    async with session.post(url, json=body) as resp:
        text = (await resp.text()).strip()
    if resp.status != 200:
        raise RuntimeError(f"POST {url} answered {resp.status}: {text}")
    print(text)


# ---- metrics ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class BenchResult:
    """Every metric of one run; field names follow SGLang's --output-file records. Times in ms."""
    backend: str
    dataset_name: str
    request_rate: float
    max_concurrency: Optional[int]
    completed: int
    failed: int
    duration: float  # seconds
    total_input_tokens: int
    total_output_tokens: int
    total_output_tokens_retokenized: int
    total_cached_tokens: int  # prompt tokens the server reported reusing from its prefix cache
    cache_hit_rate: float  # total_cached_tokens / total_input_tokens
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    max_output_tokens_per_s: float  # peak output throughput over 1 s windows
    max_concurrent_requests: int
    concurrency: float  # mean requests in flight = sum of E2E latencies / duration
    accept_length: Optional[float]
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p90_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    first_error: str = ""
    outputs: list = dataclasses.field(default_factory=list, repr=False)  # list[RequestOutput]

    def record(self) -> dict:
        """The metrics as a flat dict (asdict would deep-copy every request's outputs first)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "outputs"}


def _strict_json(value):
    # json.dumps would write Infinity (request_rate inf), which strict parsers such as jq reject.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    return value


def _stats(name: str, seconds: list, percentiles: tuple) -> dict:
    ms = np.asarray(seconds, dtype=float) * 1000.0
    if ms.size == 0:  # no successful request: zeros keep the record finite
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _peak_output_rate(outputs: list[RequestOutput], start: float, duration: float) -> float:
    """Most output tokens that arrived in any window of 1 s (the whole run when shorter), per second."""
    window = min(1.0, duration) if duration > 0 else 1.0
    buckets: dict = {}
    for o in outputs:
        for t, n in o.chunks:
            key = int((t - start) // window)
            buckets[key] = buckets.get(key, 0) + n
    return max(buckets.values(), default=0) / window


def compute_result(args, outputs: list[RequestOutput], duration: float, peak: int, start: float,
                   tok: Tokenizer) -> BenchResult:
    ok = [o for o in outputs if o.success]
    n_in, n_out = sum(o.prompt_len for o in ok), sum(o.output_len for o in ok)
    n_cached = sum(o.cached_tokens for o in ok)
    retok = sum(len(e.ids) for e in tok.encode_batch([o.generated_text for o in ok], add_special_tokens=False))
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    accept = [o.accept_length for o in ok if o.accept_length is not None]
    itl = [x for o in ok for x in o.itl]
    tpot = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itl_stats = _stats("itl", itl, (95, 99))
    itl_stats["max_itl_ms"] = float(max(itl, default=0.0) * 1000.0)
    return BenchResult(
        backend=args.backend, dataset_name=args.dataset_name, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, completed=len(ok), failed=len(outputs) - len(ok),
        duration=duration, total_input_tokens=n_in, total_output_tokens=n_out,
        total_output_tokens_retokenized=retok, total_cached_tokens=n_cached,
        cache_hit_rate=n_cached / n_in if n_in else 0.0, request_throughput=per_s(len(ok)),
        input_throughput=per_s(n_in), output_throughput=per_s(n_out), total_throughput=per_s(n_in + n_out),
        max_output_tokens_per_s=_peak_output_rate(ok, start, duration), max_concurrent_requests=peak,
        concurrency=per_s(sum(o.latency for o in ok)),
        accept_length=float(np.mean(accept)) if accept else None,
        **_stats("ttft", [o.ttft for o in ok], (99,)), **_stats("tpot", tpot, (99,)), **itl_stats,
        **_stats("e2e_latency", [o.latency for o in ok], (90, 99)),
        first_error=next((o.error for o in outputs if not o.success), ""), outputs=outputs)


def print_result(r: BenchResult) -> None:
    def line(label: str, value) -> None:
        print(f"{label + ':':<40} {value:<10.2f}" if isinstance(value, float) else f"{label + ':':<40} {value}")

    def section(title: str) -> None:
        print(title.center(50, "-"))

    print("\n" + " Serving Benchmark Result ".center(50, "="))
    line("Backend", r.backend)
    line("Dataset", r.dataset_name)
    line("Traffic request rate", r.request_rate)
    line("Max request concurrency", r.max_concurrency if r.max_concurrency else "not set")
    line("Successful requests", r.completed)
    if r.failed:
        line("Failed requests", r.failed)
    line("Benchmark duration (s)", r.duration)
    line("Total input tokens", r.total_input_tokens)
    line("Total generated tokens", r.total_output_tokens)
    line("Total generated tokens (retokenized)", r.total_output_tokens_retokenized)
    line("Total cached input tokens", r.total_cached_tokens)
    line("Prompt-token cache hit rate", r.cache_hit_rate)
    line("Request throughput (req/s)", r.request_throughput)
    line("Input token throughput (tok/s)", r.input_throughput)
    line("Output token throughput (tok/s)", r.output_throughput)
    line("Peak output token throughput (tok/s)", r.max_output_tokens_per_s)
    line("Peak concurrent requests", r.max_concurrent_requests)
    line("Total token throughput (tok/s)", r.total_throughput)
    line("Concurrency", r.concurrency)
    if r.accept_length is not None:
        line("Accept length", r.accept_length)
    for title, key, labels in (("End-to-End Latency", "e2e_latency", ("mean", "median", "p90", "p99")),
                               ("Time to First Token", "ttft", ("mean", "median", "p99")),
                               ("Time per Output Token (excl. 1st token)", "tpot", ("mean", "median", "p99")),
                               ("Inter-Token Latency", "itl", ("mean", "median", "p95", "p99", "max"))):
        section(title)
        short = {"e2e_latency": "E2E Latency"}.get(key, key.upper())
        for stat in labels:
            line(f"{stat.capitalize() if stat in ('mean', 'median', 'max') else stat.upper()} {short} (ms)",
                 getattr(r, f"{stat}_{key}_ms"))
    print("=" * 50)
    if r.failed:
        print(f"First error: {r.first_error}")


# ---- entry points -------------------------------------------------------------------------------


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Benchmark a running server's online serving throughput/latency.")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="sglang")
    add_server_args(p)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json, a directory holding one, or a hub id (default: the DeepSeek-V4 tokenizer)")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache after the warmup")
    p.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--omit-max-tokens", action="store_true",
                   help="send no max_tokens (the server's default: up to the context for chat, 16 for completions "
                        "and 128 for /generate, as upstream); each client reads its output length, then "
                        "disconnects, as if the answer had ended there (needs streaming)")
    p.add_argument("--extra-request-body", default=None,
                   help='JSON merged into each request body, e.g. \'{"sampling_params": {"top_p": 0.9}}\'')
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append one JSONL record (metrics and args) per run")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler on the server over the benchmark (/start_profile after the warmup, "
                        "/stop_profile at the end); traces go to the server's SGLANG_TORCH_PROFILER_DIR, or this "
                        "process's when set (a directory under the server's); profiling is an admin action, "
                        "which a server without --admin-api-key serves to loopback clients only")
    p.add_argument("--profile-activities", nargs="+", default=None, choices=["CPU", "GPU", "MEM", "CUDA_PROFILER"],
                   help="what to record (server default: CPU and, on a GPU, GPU)")
    p.add_argument("--profile-num-steps", type=int, default=None,
                   help="profile only this many scheduler steps from the start of the benchmark")
    p.add_argument("--profile-prefix", default=None, help="trace file names start with it")
    args = p.parse_args(argv)
    if args.dataset_name is None:  # SGLang defaults to sharegpt, which needs a downloaded file
        args.dataset_name = "sharegpt" if args.dataset_path else "random"
    if args.extra_request_body and not isinstance(json.loads(args.extra_request_body), dict):
        p.error("--extra-request-body must be a JSON object")
    if args.omit_max_tokens and args.disable_stream:
        p.error("--omit-max-tokens needs streaming: the client ends each answer by disconnecting")
    return args


def run_benchmark(args: argparse.Namespace) -> BenchResult:
    tok = load_tokenizer(args.tokenizer)
    rows = get_dataset(args, tok)
    outputs, duration, peak, start = asyncio.run(_benchmark(args, rows, tok))
    result = compute_result(args, outputs, duration, peak, start, tok)
    print_result(result)
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(_strict_json({**result.record(), "args": vars(args)}), default=str) + "\n")
    return result


def main(argv: Optional[list] = None) -> None:
    """Exit 1 when any request failed: the figures above then measure a partly failing server."""
    result = run_benchmark(parse_args(argv))
    if result.failed:
        raise SystemExit(f"error: {result.failed} of {result.completed + result.failed} requests failed "
                         f"(first error: {result.first_error})")


if __name__ == "__main__":
    main()
