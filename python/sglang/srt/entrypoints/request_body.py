"""Reading a JSON request body defensively: media type, size limit, nesting depth and valid unicode, then the
endpoint's pydantic model (`parse_request`).

Every problem becomes a RequestError (4xx) naming it, so no body a client sends reaches a 500: a body over the
limit is refused from its Content-Length or while it streams in (never held whole), deep nesting is refused before
anything recurses on it, and a lone UTF-16 surrogate (legal as a JSON escape, not encodable as UTF-8) is refused
with the field that holds it instead of failing later in the tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from sglang.srt.managers.tokenizer_manager import RequestError

MAX_JSON_DEPTH = 128  # far beyond any real request (tool schemas included); json.loads itself recurses at ~1000


def check_media_type(content_type: str) -> None:
    """Accept JSON bodies only, as FastAPI's typed bodies do: application/json, application/*+json, or no
    Content-Type at all. A text/plain or form POST is a CORS "simple request" a web page may send cross-site
    without a preflight, so it must not be read as JSON."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media in ("", "application/json") or (media.startswith("application/") and media.endswith("+json")):
        return
    raise RequestError(f"unsupported Content-Type '{content_type}': send the body as application/json", 415)


def _too_large(limit_bytes: int) -> RequestError:
    return RequestError(f"the request body is larger than the server's limit of {limit_bytes / 2**20:g} MiB "
                        "(--max-request-body-mb)", 413)


async def read_limited(raw: Request, limit_bytes: int) -> bytes:
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise _too_large(limit_bytes)
    chunks, size = [], 0
    async for chunk in raw.stream():  # chunked bodies carry no length: count as they arrive
        size += len(chunk)
        if size > limit_bytes:
            raise _too_large(limit_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _path(parent: str, key) -> str:
    return f"{parent}.{key}" if parent else str(key)


def _shown(where: str) -> str:
    return "body" if not where else (where if len(where) <= 80 else where[:77] + "...")


def _check_text(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        # the path may hold the bad key itself: escaped, so the error reply can be encoded
        where = where.encode("utf-8", "backslashreplace").decode("utf-8")
        raise RequestError(f"invalid field '{_shown(where)}': invalid unicode, a lone UTF-16 surrogate "
                           f"\\u{ord(text[e.start]):04x} at character {e.start}", param=where or None) from None


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse nesting deeper than max_depth and strings (values or keys) that are not valid unicode. Iterative,
    so the check itself cannot overflow the stack."""
    if isinstance(value, str):
        _check_text(value, "")
    stack = [(value, "", 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, where, depth = stack.pop()
        if depth > max_depth:
            raise RequestError(f"the JSON body nests deeper than {max_depth} levels (at '{_shown(where)}')",
                               param=where or None)
        for key, item in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(key, str):
                _check_text(key, _path(where, key))
            if isinstance(item, str):
                _check_text(item, _path(where, key))
            elif isinstance(item, (dict, list)):
                stack.append((item, _path(where, key), depth + 1))


def parse_json(data: bytes) -> Any:
    try:
        body = json.loads(data)
    except RecursionError:
        raise RequestError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON body: {e}") from None
    check_json_value(body)
    return body


async def read_json(raw: Request, limit_bytes: int) -> Any:
    check_media_type(raw.headers.get("content-type", ""))
    return parse_json(await read_limited(raw, limit_bytes))


async def parse_request(raw: Request, model: type, empty_ok: bool = False) -> BaseModel:
    """The body as `model`; a field that does not validate is a 400 naming it (FastAPI would answer 422).
    `empty_ok`: no body at all (a bare POST, a GET) is `model`'s defaults."""
    limit = raw.app.state.max_request_body_bytes
    if empty_ok:
        data = await read_limited(raw, limit)
        if not data.strip():
            return model()
        check_media_type(raw.headers.get("content-type", ""))
        body = parse_json(data)
    else:
        body = await read_json(raw, limit)
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
