"""Who may call the admin endpoints, from any client address: the real app (create_app) over a stub TokenizerManager
that records what reaches it (httpx's ASGI transport sets the client address, so remote clients need no network);
the admin paths confined to their directories; the weight rows bounded before any copy. The same endpoints against a
real server with both keys: test_hardening_http.py."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import httpx

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.server_args import ServerArgs
from test_hardening_http import ADMIN, ADMIN_KEY, ADMIN_REQUESTS, AUTH, KEY, error_of


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

    async def clear_hicache_storage(self):
        self.calls.append("clear storage")

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
                       ("/update_weights_from_disk", {"model_path": "served-id"}),
                       ("/clear_hicache_storage_backend", None)]  # (a real server answers 400 without a file tier)


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
