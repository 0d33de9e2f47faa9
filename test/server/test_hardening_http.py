"""Hostile and malformed HTTP input against a real server: every bad body is a 4xx
naming the problem, big bodies are bounded and tokenized off the event loop, unknown routes get the error body,
secrets never leave the server, and an unexpected exception is a generic 500 whose details are only in the log.
The admin endpoints take only the admin key (or, without one, loopback clients only: the in-process tests at the
end, whose clients have any address), load and write only under their directories, and answer bounded payloads; a
stored response is seen only with the key that created it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from types import SimpleNamespace

import httpx
import pytest
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


# ---- who may call the admin endpoints, from any client address: the real app over a stub TokenizerManager --------
class AdminStub:
    """What the admin endpoints call on the TokenizerManager, recorded."""

    def __init__(self, served_dir: str = "/nonexistent/served") -> None:
        self.ready = SimpleNamespace(model_path=served_dir)
        self.states, self.calls, self.weights_path = {}, [], None

    def start(self) -> None:
        pass

    async def flush_cache(self):
        self.calls.append("flush")

    async def abort_matching(self, rid, abort_all):
        self.calls.append(("abort", rid, abort_all))
        return []

    async def update_weights_from_disk(self, path, abort_all=False):
        self.calls.append(("load", path))
        return f"weights updated from {path}"

    async def get_weights_by_name(self, name, truncate_size):
        import torch

        self.calls.append(("rows", name))
        return torch.ones(truncate_size, 3)

    async def profile(self, start, config=None):
        self.calls.append(("profile", start, config))
        return "ok"

    async def expert_distribution(self, action):
        self.calls.append(("experts", action))
        return "ok"


STUB_ADMIN_REQUESTS = [*[(p, b) for p, b in ADMIN_REQUESTS if p != "/update_weights_from_disk"],
                       ("/update_weights_from_disk", {"model_path": "served-id"})]


def call_from(app, host: str, path: str, body=None, headers=None) -> httpx.Response:
    """One POST as a client at `host` sees it answered (httpx's ASGI transport sets the client address)."""
    async def go():
        transport = httpx.ASGITransport(app=app, client=(host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost:30000") as client:
            return await client.post(path, json=body, headers=headers)

    return asyncio.run(go())


def test_admin_endpoints_refuse_remote_clients_without_an_admin_key():
    from sglang.srt.entrypoints.access import ADMIN_PATHS

    assert {path for path, _ in STUB_ADMIN_REQUESTS} == ADMIN_PATHS | {"/abort_request"}  # each one tried: a route
    stub = AdminStub()
    app = create_app(stub, ServerArgs(model_path="served-id"))
    for host in ("10.0.0.5", "192.168.1.20", "2001:db8::1", "::ffff:10.0.0.5", "0.0.0.0"):
        for path, body in STUB_ADMIN_REQUESTS:
            err = error_of(call_from(app, host, path, body), 403)
            assert "loopback" in err["message"] and "--admin-api-key" in err["message"], (host, path, err)
    assert stub.calls == []  # nothing ran
    assert call_from(app, "10.0.0.5", "/abort_request", {"rid": "mine"}).status_code == 200  # not an admin action
    for host in ("127.0.0.1", "127.4.5.6", "::1", "::ffff:127.0.0.1"):
        stub.calls.clear()
        for path, body in STUB_ADMIN_REQUESTS:
            assert call_from(app, host, path, body).status_code == 200, (host, path)
        assert len(stub.calls) == len(STUB_ADMIN_REQUESTS), stub.calls


def test_admin_endpoints_refuse_web_pages_on_loopback():
    """A page of another site makes the browser call localhost (Origin, Sec-Fetch-Site), or reaches it under its own
    name by DNS rebinding (Host): not a local tool, so refused without an admin key. The server's own pages (same
    origin), an address typed in the browser and the loopback names are served."""
    stub = AdminStub()
    app = create_app(stub, ServerArgs(model_path="served-id"))
    refused = [{"Host": "evil.example:30000"}, {"Host": "localhost.evil.example"}, {"Host": "[::1"},
               {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site", "Origin": "http://localhost:8888"},
               {"Origin": "http://evil.example"}, {"Origin": "null"}]
    for headers in refused:
        for path, body in STUB_ADMIN_REQUESTS:
            err = error_of(call_from(app, "127.0.0.1", path, body, headers), 403)
            assert "local tools" in err["message"], (headers, err)
    assert stub.calls == []
    served = [{"Host": "127.0.0.1:30000"}, {"Host": "[::1]:30000"}, {"Host": "LOCALHOST."}, {"Sec-Fetch-Site": "none"},
              {"Sec-Fetch-Site": "same-origin", "Origin": "http://localhost:30000"}]
    for headers in served:
        assert call_from(app, "127.0.0.1", "/flush_cache", None, headers).status_code == 200, headers
    assert call_from(app, "127.0.0.1", "/generate", None, {"Host": "evil.example"}).status_code != 403  # not admin


def test_admin_key_is_needed_from_every_address_once_set():
    stub = AdminStub()
    app = create_app(stub, ServerArgs(model_path="served-id", api_key=KEY, admin_api_key=ADMIN_KEY))
    for host in ("10.0.0.5", "127.0.0.1"):  # with an admin key, loopback is not enough
        for path, body in STUB_ADMIN_REQUESTS:
            assert error_of(call_from(app, host, path, body), 401)["type"] == "AuthenticationError"
            for headers in (AUTH, {"Authorization": f"Bearer {ADMIN_KEY[:-1]}"}, {"Authorization": ADMIN_KEY}):
                bad_api_key = path == "/abort_request" and headers is not AUTH  # see the real server's test
                error_of(call_from(app, host, path, body, headers), 401 if bad_api_key else 403)
            assert call_from(app, host, path, body, ADMIN).status_code == 200, (host, path)
    assert call_from(app, "10.0.0.5", "/abort_request", {"rid": "mine"}, AUTH).status_code == 200
    assert call_from(app, "10.0.0.5", "/abort_request", {"rid": "mine"}).status_code == 401  # the API key still


def test_weight_updates_load_only_under_the_weights_dir(tmp_path):
    models, outside = tmp_path / "models", tmp_path / "outside"
    for d in (models / "served", models / "step-200", outside):
        d.mkdir(parents=True)
    (models / "escape").symlink_to(outside)
    stub = AdminStub(str(models / "served"))

    def load(path, **args) -> httpx.Response:
        stub.calls.clear()
        app = create_app(stub, ServerArgs(model_path="served-id", **args))
        return call_from(app, "127.0.0.1", "/update_weights_from_disk", {"model_path": path})

    step, away = os.path.realpath(models / "step-200"), os.path.realpath(outside)  # what is loaded: symlinks resolved
    allowed = [("served-id", {}, "served-id"), (str(models / "step-200"), {}, step),
               (str(models / "served" / ".." / "step-200"), {}, step),
               ("org/other-model", {"allow_hub_weight_updates": True}, "org/other-model"),
               (str(outside), {"weights_dir": str(outside)}, away)]
    for path, args, loaded in allowed:
        r = load(path, **args)
        assert r.status_code == 200 and r.json()["success"] is True, (path, r.text)
        assert stub.calls == [("load", loaded)], stub.calls
    refused = [(str(outside), {}, "--weights-dir"), (str(models / "escape"), {}, "--weights-dir"),
               (str(models / "step-200" / ".." / ".." / "outside"), {}, "--weights-dir"),
               ("/", {}, "--weights-dir"), ("org/other-model", {}, "--allow-hub-weight-updates"),
               (str(models / "step-200"), {"weights_dir": str(outside)}, "--weights-dir"),
               ("/a\x00b", {}, "NUL")]
    for path, args, says in refused:
        r = load(path, **args)
        assert r.status_code == 400 and r.json()["success"] is False, (path, r.text)
        assert "model_path" in r.json()["message"] and says in r.json()["message"], r.text
        assert stub.calls == [], (path, stub.calls)


def test_profile_traces_stay_under_the_profiler_dir(tmp_path, monkeypatch):
    root, elsewhere = tmp_path / "traces", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "link").symlink_to(elsewhere)
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(root))
    stub = AdminStub()
    app = create_app(stub, ServerArgs(model_path="x"))
    for output_dir, lands in ((None, root), ("run-1", root / "run-1"), (str(root / "a" / "b"), root / "a" / "b"),
                              ("a/../b", root / "b")):
        stub.calls.clear()
        assert call_from(app, "::1", "/start_profile", {"output_dir": output_dir}).status_code == 200
        assert stub.calls[0][2].output_dir == str(lands), (output_dir, stub.calls)
    stub.calls.clear()
    for output_dir in ("..", "../elsewhere", str(elsewhere), "link", "link/deeper", "/", "a\x00"):
        err = error_of(call_from(app, "::1", "/start_profile", {"output_dir": output_dir}), 400)
        assert err["param"] == "output_dir", (output_dir, err)
    for prefix in ("a/b", "../../etc/x", "", "x" * 129):
        err = error_of(call_from(app, "::1", "/start_profile", {"profile_prefix": prefix}), 400)
        assert err["param"] == "profile_prefix", (prefix, err)
    assert stub.calls == []


def test_weight_rows_are_bounded_in_values_before_any_copy():
    """1,000 rows of a wide or stacked tensor could be gigabytes of JSON: the scheduler refuses an answer of more than
    MAX_WEIGHT_VALUES values (a 400 naming truncate_size) and says how many rows fit."""
    import functools

    import torch

    from sglang.srt.managers.io_struct import MAX_WEIGHT_VALUES, GetWeightsReq
    from sglang.srt.managers.scheduler_process import SchedulerProcess
    from sglang.srt.model_executor.model_runner import ModelRunner

    model = torch.nn.Module()
    width = 9000
    model.register_buffer("wide", torch.zeros(1).expand(2000, width))  # no memory behind it
    model.register_buffer("stacked", torch.zeros(1).expand(4, 1000, MAX_WEIGHT_VALUES // 1000))
    runner = SimpleNamespace(model=model, draft_model=None)
    runner.weight_rows = functools.partial(ModelRunner.weight_rows, runner)
    proc = SchedulerProcess.__new__(SchedulerProcess)
    proc.scheduler = SimpleNamespace(runner=runner)
    fit = MAX_WEIGHT_VALUES // width
    for name, rows, allowed in (("wide", fit, True), ("wide", fit + 1, False), ("wide", 1000, False),
                                ("stacked", 1, True), ("stacked", 2, False)):
        out = proc._get_weights(GetWeightsReq("r", name, rows))
        if allowed:
            assert out.status_code == 200 and out.data.shape[0] == rows, out.message
        else:
            assert out.status_code == 400 and "truncate_size" in out.message, out.message
            assert f"at most {fit if name == 'wide' else 1} rows" in out.message, out.message
