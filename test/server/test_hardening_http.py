"""Hostile and malformed HTTP input against a real server: every bad body is a 4xx
naming the problem, big bodies are bounded and tokenized off the event loop, unknown routes get the error body,
secrets never leave the server, an unexpected exception is a generic 500 whose details are only in the log, and a
stop_regex that a backtracking engine would take exponential time on delays no other request.
The admin endpoints take only the admin key (without one, loopback clients only: test_admin_access.py, whose
clients have any address), load and write only under their directories, and answer bounded payloads; a
stored response is seen only with the key that created it."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
from types import SimpleNamespace

import httpx
import pytest
import re2
from fastapi.testclient import TestClient

from server_process import launch
from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.server_args import ServerArgs

MODEL = "tiny-deepseek-v4"
KEY = "sk-hardening-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_KEY = "sk-admin-hardening-key-9876543210"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LIMIT_MB = 6
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("hardening")
    handle = launch(["--model-path", MODEL, "--api-key", KEY, "--admin-api-key", ADMIN_KEY, "--max-request-body-mb",
                     str(LIMIT_MB), "--context-length", "1024", "--max-running-requests", "8",
                     "--expert-distribution-recorder-mode", "stat"], str(out),
                    env={"SGLANG_TORCH_PROFILER_DIR": str(out), "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(out)})
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as client:
        yield client


def post_raw(http, path: str, body: bytes, content_type: str = "application/json") -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": content_type})


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()
    assert err["object"] == "error" and err["code"] == status and err["type"] and err["message"], err
    nested = err["error"]  # OpenAI's shape beside SGLang's flat one
    assert nested == {k: err[k] for k in ("message", "type", "param", "code")}, err
    return err


def test_deeply_nested_json_is_400(http):
    deep = b"[" * 10_000 + b"]" * 10_000
    for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/tokenize"):
        assert "nests deeper" in error_of(post_raw(http, path, deep), 400)["message"]
    # Deep enough to hurt later (pydantic, the chat encoder), shallow enough for json.loads: refused too.
    nested = json.loads("[" * 300 + "]" * 300)
    err = error_of(http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": nested}), 400)
    assert "nests deeper" in err["message"] and "chat_template_kwargs" in err["message"]


def test_lone_surrogate_is_400_naming_the_field(http):
    cases = [("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]},
              "messages.0.content"),
             ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
             ("/v1/completions", {"model": MODEL, "prompt": ["ok", "a\udfffb"], "max_tokens": 2}, "prompt.1"),
             ("/generate", {"text": "a\ud800b", "sampling_params": {"max_new_tokens": 2}}, "text"),
             ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
             # a bad key: the error names it escaped (the reply must still encode)
             ("/v1/chat/completions", {**CHAT, "\udc00": 1}, "\\udc00"),
             ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "\ud800": 1}]},
              "messages.0.\\ud800"),
             ("/generate", {"text": "x", "\udfff": 1}, "\\udfff")]
    for path, body, field in cases:
        raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as the JSON escape \ud800
        assert b"\\ud" in raw
        err = error_of(post_raw(http, path, raw), 400)
        assert "unicode" in err["message"] and err["param"] == field, (path, err)
    # A proper surrogate pair (an escaped emoji) is valid unicode and accepted.
    ok = json.dumps({**CHAT, "messages": [{"role": "user", "content": "smile \U0001F600"}]}).encode()
    assert post_raw(http, "/v1/chat/completions", ok).status_code == 200


def test_seed_beyond_64_bits_is_400_naming_seed(http):
    for seed in (2**64, -(2**63) - 1, 10**30):
        for path, body in (("/v1/chat/completions", {**CHAT, "seed": seed}),
                           ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "seed": seed}),
                           ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "seed": seed}})):
            err = error_of(http.post(path, json=body), 400)
            assert "seed" in err["message"], (path, seed, err)
    # The extremes of the range work, n > 1 included (choice i > 0: a 64-bit mix of the seed and i, in range).
    top = http.post("/v1/chat/completions", json={**CHAT, "seed": 2**63 - 1, "n": 2, "temperature": 1.0})
    assert top.status_code == 200 and len(top.json()["choices"]) == 2, top.text
    assert http.post("/v1/chat/completions", json={**CHAT, "seed": -(2**63)}).status_code == 200


def test_generate_takes_upstream_sampling_fields(http):
    """Upstream SGLang's clients send every SamplingParams field at its default: accepted; a field we do not
    implement at another value is a 400 naming it."""
    upstream = {"max_new_tokens": 2, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None,
                "stop_regex": None, "spaces_between_special_tokens": True, "stop": None, "sampling_seed": None}
    assert http.post("/generate", json={"text": "x", "sampling_params": upstream}).status_code == 200
    err = error_of(http.post("/generate", json={"text": "x", "sampling_params": {**upstream, "stream_interval": 4}}),
                   400)
    assert err["param"] == "stream_interval" and "not supported yet" in err["message"]
    spaced = http.post("/generate", json={"text": "x", "sampling_params": {**upstream,
                                                                           "spaces_between_special_tokens": False}})
    assert spaced.status_code == 200, spaced.text
    ok = http.post("/generate", json={"text": "x", "sampling_params": {**upstream, "max_new_tokens": 8,
                                                                       "regex": "a+"}})
    assert ok.status_code == 200 and set(ok.json()["text"]) <= {"a"}, ok.text
    err = error_of(http.post("/generate", json={"text": "x", "sampling_params": {**upstream, "regex": "(a"}}), 400)
    assert "regex does not compile" in err["message"]
    err = error_of(http.post("/generate", json={"text": "x", "sampling_params": {**upstream, "stop_regex": "("}}),
                   400)
    assert err["param"] == "stop_regex" and "valid regular expressions" in err["message"]
    for bad in (0, 17, 1.5, True, "2"):
        err = error_of(http.post("/generate", json={"text": "x", "sampling_params": {**upstream, "n": bad}}), 400)
        assert err["param"] == "n", bad
    err = error_of(http.post("/generate", json={"text": ["x", "y"], "sampling_params": [{"n": 2}, {"n": 3}]}), 400)
    assert err["param"] == "n" and "same for every prompt" in err["message"]


def test_json_media_type_is_required(http):
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x"):
        err = error_of(post_raw(http, "/v1/completions", body, ctype), 415)
        assert "Content-Type" in err["message"] and "application/json" in err["message"]
    for ctype in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json"):
        assert post_raw(http, "/v1/completions", body, ctype).status_code == 200, ctype
    assert post_raw(http, "/v1/completions", body, "").status_code == 200  # none at all, as FastAPI allows


def test_body_over_the_limit_is_413(http):
    over = b" " * (LIMIT_MB * 2**20 + 1)
    err = error_of(post_raw(http, "/v1/completions", over), 413)
    assert "--max-request-body-mb" in err["message"]

    def chunked():  # no Content-Length: the server must count while it reads
        for _ in range(LIMIT_MB * 16 + 1):
            yield b" " * 65536

    assert "limit" in error_of(post_raw(http, "/generate", chunked()), 413)["message"]
    padded = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "u" * (LIMIT_MB - 1) * 2**20})
    assert post_raw(http, "/v1/completions", padded.encode()).status_code == 200  # under the limit: served


def test_health_answers_while_a_big_body_is_tokenized(server):
    """5 MB of chat (and 1 MB prompts on the other text endpoints) take seconds to encode; /health must keep
    answering meanwhile. Once a big body is uploaded, /health is probed back to back until its answer comes:
    encoding on the event loop (or in a thread holding the GIL) lets at most a couple of probes through, so many
    answers are asked for (a count, not a latency)."""
    big = "hello world, some text. " * (5 * 2**20 // 24)
    requests = [("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": big}]}),
                ("/v1/completions", {"model": MODEL, "prompt": big[:2**20], "max_tokens": 2}),
                ("/generate", {"text": big[:2**20], "sampling_params": {"max_new_tokens": 2}})]

    async def one(client, path, body) -> tuple:
        data, uploaded = json.dumps(body).encode(), asyncio.Event()

        async def chunks():
            for i in range(0, len(data), 2**16):
                yield data[i:i + 2**16]
            uploaded.set()

        pending = asyncio.create_task(client.post(path, content=chunks(),
                                                  headers={"content-type": "application/json"}))
        await uploaded.wait()
        await asyncio.sleep(0.1)  # the server reads the socket's last bytes and parses the JSON
        during = 0
        while not pending.done():
            assert (await client.get("/health", timeout=60)).status_code == 200
            during += not pending.done()
            await asyncio.sleep(0.01)
        return pending.result(), during

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=300) as client:
            return [await one(client, path, body) for path, body in requests]

    for (path, _), (r, during) in zip(requests, asyncio.run(main())):
        # tokenized in full, then refused for the context length: a clean 4xx
        assert r.status_code == 400 and "context length" in r.json()["message"], (path, r.text)
        assert during >= 10, f"/health answered only {during} times while {path} was being tokenized"


def test_unknown_route_and_wrong_method_use_the_error_body(http):
    err = error_of(http.get("/v1/nothing-here"), 404)
    assert err["type"] == "NotFoundError" and "/v1/nothing-here" in err["message"]
    r = http.get("/v1/chat/completions")
    err = error_of(r, 405)
    assert err["type"] == "MethodNotAllowedError" and "GET" in err["message"]
    assert "POST" in r.headers["allow"]


def test_server_info_never_returns_the_key(http):
    for path in ("/server_info", "/get_server_info"):
        r = http.get(path)
        assert r.status_code == 200 and KEY not in r.text and ADMIN_KEY not in r.text
        assert r.json()["api_key"] == r.json()["admin_api_key"] == "***" and r.json()["model_path"] == MODEL


def test_api_key_checks(server, http):
    wrong_same_length = KEY[:-1] + ("x" if KEY[-1] != "x" else "y")
    for headers in ({}, {"Authorization": f"Bearer {wrong_same_length}"}, {"Authorization": f"Bearer {KEY}x"},
                    {"Authorization": KEY}, {"Authorization": f"Bearer {KEY[:-1]}é".encode()}):
        r = httpx.get(f"{server.base_url}/v1/models", headers=headers)
        err = error_of(r, 401)
        assert err["type"] == "AuthenticationError" and KEY not in r.text
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # load balancers probe without a key


# Every admin endpoint with a body it accepts (in this order: the profile and the record are started, then stopped).
ADMIN_REQUESTS = [("/flush_cache", None), ("/get_weights_by_name", {"name": "layers.0.attn.wq_a.weight"}),
                  ("/update_weights_from_disk", {"model_path": MODEL}), ("/start_profile", {"output_dir": "admin"}),
                  ("/stop_profile", None), ("/start_expert_distribution_record", None),
                  ("/stop_expert_distribution_record", None), ("/dump_expert_distribution_record", None),
                  ("/abort_request", {"abort_all": True})]


def test_admin_endpoints_take_only_the_admin_key(server):
    wrong = ADMIN_KEY[:-1] + ("x" if ADMIN_KEY[-1] != "x" else "y")
    for path, body in ADMIN_REQUESTS:
        def call(headers):
            return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=120)

        assert error_of(call({}), 401)["type"] == "AuthenticationError", path
        for key in (KEY, wrong, ADMIN_KEY + "x"):  # the API key does not grant admin
            if key != KEY and path == "/abort_request":  # not an admin path: a key that is neither is a bad API key
                error_of(call({"Authorization": f"Bearer {key}"}), 401)
                continue
            err = error_of(call({"Authorization": f"Bearer {key}"}), 403)
            assert err["type"] == "PermissionDeniedError" and "--admin-api-key" in err["message"], (path, err)
        r = call(ADMIN)
        assert r.status_code == 200, (path, r.text)
    # The admin key is also an API key; aborting one's own request by rid is not an admin action.
    assert httpx.get(f"{server.base_url}/v1/models", headers=ADMIN).status_code == 200
    assert httpx.post(f"{server.base_url}/abort_request", json={"rid": "none"}, headers=AUTH).status_code == 200


def test_admin_paths_are_confined_and_payloads_bounded(server):
    def admin(path, body):
        return httpx.post(f"{server.base_url}{path}", json=body, headers=ADMIN, timeout=120)

    for model_path in ("/etc", "/", "../" * 12 + "etc", "deepseek-ai/DeepSeek-V4-Flash"):
        r = admin("/update_weights_from_disk", {"model_path": model_path})
        assert r.status_code == 400 and r.json()["success"] is False, (model_path, r.text)
        assert "model_path" in r.json()["message"], r.text
    for output_dir in ("/etc", "../escape", "/"):
        err = error_of(admin("/start_profile", {"output_dir": output_dir}), 400)
        assert err["param"] == "output_dir" and "SGLANG_TORCH_PROFILER_DIR" in err["message"], err
    for field in ("profile_prefix", "profile_id"):
        assert error_of(admin("/start_profile", {field: "../../x"}), 400)["param"] == field
    assert admin("/stop_profile", None).status_code == 400  # none of them started a profile
    err = error_of(admin("/get_weights_by_name", {"name": "layers.0.attn.wq_a.weight", "truncate_size": 1001}), 400)
    assert err["param"] == "truncate_size" and "1000" in err["message"], err
    rows = admin("/get_weights_by_name", {"name": "layers.0.attn.wq_a.weight", "truncate_size": 1000})
    assert rows.status_code == 200 and rows.headers["content-type"] == "application/json"
    assert 0 < len(rows.json()) <= 1000 and all(isinstance(v, float) for v in rows.json()[0])


def test_stored_responses_are_their_keys_own(server, http):
    """Another key reads, continues, cancels or deletes a stored response as if it did not exist (404)."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    created = http.post("/v1/responses", json=body)
    assert created.status_code == 200, created.text
    rid = created.json()["id"]
    other = httpx.Client(base_url=server.base_url, headers=ADMIN, timeout=120)
    unknown = error_of(other.get("/v1/responses/resp_unknown"), 404)["message"]
    for r in (other.get(f"/v1/responses/{rid}"), other.get(f"/v1/responses/{rid}?stream=true"),
              other.post(f"/v1/responses/{rid}/cancel"), other.delete(f"/v1/responses/{rid}")):
        assert error_of(r, 404)["message"] == unknown.replace("resp_unknown", rid), r.text
    err = error_of(other.post("/v1/responses", json={**body, "previous_response_id": rid}), 404)
    assert err["param"] == "previous_response_id"
    assert http.get(f"/v1/responses/{rid}").json()["id"] == rid  # still there for its owner
    assert http.post("/v1/responses", json={**body, "previous_response_id": rid}).status_code == 200
    assert http.delete(f"/v1/responses/{rid}").status_code == 200
    other.close()


# Patterns a backtracking engine takes about 2**n steps on over n x's without a y (the scheduler searches the last 32
# tokens' text after every token, the detokenizer searches on the HTTP process's event loop).
CATASTROPHIC = [r"(x+x+)+y", r"(x|xx)+y", r"(x+)+\s?y"]
RUN_OF_X = {"regex": "x+", "ignore_eos": True, "temperature": 0}  # a long run of x, whatever the model prefers


async def stream_generate(client, body: dict):
    """Yields (arrival time, completion tokens so far, text) per event of a streamed /generate."""
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                yield asyncio.get_running_loop().time(), event["meta_info"]["completion_tokens"], event


def test_catastrophic_stop_regex_does_not_delay_other_requests(server):
    """A request generating a long run of x with CATASTROPHIC stop regexes, beside a greedy request streamed at the
    same time: the greedy request's tokens come about as fast as beside the same run of x with a trivial stop_regex
    (RE2 searches the window in time linear in it). The hostile patterns must add less than one decode step (the
    trivial rounds' median per-token gap) to the median gap of at least one of three alternating rounds: load on a
    shared machine slows some rounds, a backtracking engine slows all of them (or ends none). The hostile request is
    still running when the greedy one ends, and its output is x's only (the text those patterns blow up on)."""
    hostile_tokens, greedy_tokens = 120, 48

    async def greedy_gaps(client, stop_regex) -> list:
        events, full = [], asyncio.Event()

        async def run_of_x():
            async for t, n, event in stream_generate(client, {"text": "x", "sampling_params": {
                    **RUN_OF_X, "max_new_tokens": hostile_tokens, "stop_regex": stop_regex}}):
                events.append((t, event))
                if n >= 40:  # the window is full of x: the greedy request starts
                    full.set()

        other, waiter = asyncio.create_task(run_of_x()), asyncio.ensure_future(full.wait())
        await asyncio.wait({other, waiter}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        if other.done():
            other.result()  # its error, if any
        assert full.is_set(), "the run of x did not reach 40 tokens"
        gaps, last = [], None
        async for t, n, _ in stream_generate(client, {"text": "Once upon a time", "sampling_params": {
                "temperature": 0, "ignore_eos": True, "max_new_tokens": greedy_tokens}}):
            if last is not None and n > last[1]:
                gaps += [(t - last[0]) / (n - last[1])] * (n - last[1])
            last = (t, n)
        assert last[1] == greedy_tokens
        await other
        ended, event = events[-1]
        assert ended > last[0], "the run of x ended before the greedy request"
        assert event["meta_info"]["finish_reason"] == {"type": "length", "length": hostile_tokens}
        assert set(event["text"]) == {"x"} and len(event["text"]) >= hostile_tokens, event["text"]
        return gaps

    async def main() -> tuple:
        trivial, catastrophic = [], []
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as client:
            for _ in range(3):
                trivial += await greedy_gaps(client, ["y"])
                catastrophic.append(statistics.median(await greedy_gaps(client, CATASTROPHIC)))
        return statistics.median(trivial), catastrophic

    step, hostile = asyncio.run(main())
    assert min(hostile) < 2 * step, f"median gaps {hostile} s beside the catastrophic stop regexes, {step} s without"
    server.wait_pools_free(headers=AUTH)


def fuzzed_stop_regex(rng: random.Random):
    atoms = ["x", "xx", "a", ".", r"\w", r"\pL", "[^y]", r"\s", "é", "(x|xx)", "(x+x+)", "(a|aa)", r"\d", "(?:x)"]
    quantifiers = ["", "+", "*", "?", "{2,}", "{1000}", "+?", "++", "{0,200}", "{3}"]
    shapes = ["(@)+", "@$", "^@", "(?=@)x", r"(@)\1", "(?<!a)@", "(?i)@y", "@y", "(@)+z", "@" * 40]
    pattern = "".join(rng.choice(atoms) + rng.choice(quantifiers) for _ in range(rng.randint(1, 4)))
    for _ in range(rng.randint(0, 2)):
        pattern = rng.choice(shapes).replace("@", pattern)
    return pattern if rng.random() < 0.7 else [pattern] * rng.randint(1, 17)


def test_fuzzed_stop_regexes_are_served_or_refused_naming_the_field(server):
    """Seeded hostile stop regexes (nested quantifiers, backreferences, lookaround, huge repetitions, long and many
    patterns), sent concurrently over runs of x: each request either ends (a match, with its text, or the length) or
    is a 400 naming stop_regex; what RE2 cannot run is refused as such."""
    rng = random.Random(48)
    cases = [fuzzed_stop_regex(rng) for _ in range(40)]
    cases += [r"(x)\1", r"(?=x)x", r"(?<=x)y", r"(?P<a>x)(?P=a)", "x" * 1001, [r"\pL+", r"\pN\pL"], ["y"] * 17, "",
              "x*", 5, [None], {"x": 1}, "(", r"(x+x+)+y", r"[\s\S]{1000}"]
    refused_syntax = [r"(x)\1", r"(?=x)x", r"(?<=x)y", r"(?P<a>x)(?P=a)"]

    async def one(client, gate, stop_regex):
        async with gate:
            return await client.post("/generate", json={"text": "x", "sampling_params": {
                **RUN_OF_X, "max_new_tokens": 40, "stop_regex": stop_regex}})

    async def main():
        gate = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as client:
            return await asyncio.gather(*(one(client, gate, case) for case in cases))

    served = 0
    for case, r in zip(cases, asyncio.run(main())):
        if r.status_code == 400:
            assert error_of(r, 400)["param"] == "stop_regex", (case, r.text)
            assert case not in refused_syntax or "RE2 syntax" in r.json()["message"], (case, r.text)
            continue
        assert r.status_code == 200 and case not in refused_syntax, (case, r.status_code, r.text)
        reason, served = r.json()["meta_info"]["finish_reason"], served + 1
        assert reason["type"] in ("stop", "length"), (case, reason)
        if reason["type"] == "stop":
            patterns = [case] if isinstance(case, str) else case
            assert any(re2.search(p, reason["matched"]) for p in patterns), (case, reason)
    assert served >= 10  # the fuzz reaches the searches, not only the validation
    server.wait_pools_free(headers=AUTH)


def test_server_still_serves_after_bad_inputs(server, http):
    """Runs last in the module: after everything above, a normal request works and no slot is leaked."""
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    server.wait_pools_free(headers=AUTH)


# ---- the 500 path needs a handler that fails: the real app over a stub TokenizerManager, in-process ------------
def test_unhandled_exception_is_a_generic_500_with_request_id(caplog):
    tm = SimpleNamespace(start=lambda: None, ready=None)
    app = create_app(tm, ServerArgs(model_path="stub", api_key="secret-in-args"))
    secret = "/home/alice/prompt: my password is hunter2"

    @app.get("/boom")
    async def boom():
        raise RuntimeError(secret)

    client = TestClient(app, raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR, logger="sglang.srt.entrypoints.http_server"):
        r = client.get("/boom", headers={"Authorization": "Bearer secret-in-args"})
    err = error_of(r, 500)
    request_id = r.headers["x-request-id"]
    assert err["message"] == f"internal server error (request id {request_id})" and "hunter2" not in r.text
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and logged[0].exc_info and secret in str(logged[0].exc_info[1])
