"""/start_profile and /stop_profile on a real server (the built-in tiny model, CPU): traces land in the server's
SGLANG_TORCH_PROFILER_DIR or the body's output_dir under it, wrong requests are 400s naming the field and leave no
profile running, a client that is not on loopback is refused (no --admin-api-key here), and `sglang.bench_serving
--profile` profiles a benchmark end to end."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import httpx
import pytest

from server_process import launch


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env_dir = tmp_path_factory.mktemp("server_traces")
    old = os.environ.get("SGLANG_TORCH_PROFILER_DIR")
    os.environ["SGLANG_TORCH_PROFILER_DIR"] = str(env_dir)  # the server process inherits it
    try:
        handle = launch(["--model-path", "tiny-deepseek-v4"], str(tmp_path_factory.mktemp("server")))
    finally:
        if old is None:
            os.environ.pop("SGLANG_TORCH_PROFILER_DIR")
        else:
            os.environ["SGLANG_TORCH_PROFILER_DIR"] = old
    handle.trace_dir = env_dir
    yield handle
    handle.stop()


def _traces(directory) -> list:
    return sorted(p for p in os.listdir(directory) if p.endswith(".trace.json.gz"))


def _ops(path) -> set:
    with gzip.open(path, "rt") as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def _post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", timeout=120, **kw)


def test_start_and_stop_profile(server):
    started = _post(server, "/start_profile")  # no body: every default
    assert started.status_code == 200 and started.text.startswith("Start profiling"), started.text
    again = _post(server, "/start_profile", json={})
    assert again.status_code == 400 and "already running" in again.json()["message"]
    out = _post(server, "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})
    assert out.status_code == 200
    stopped = _post(server, "/stop_profile")
    assert stopped.status_code == 200, stopped.text
    (trace,) = _traces(server.trace_dir)
    assert trace.endswith("-TP-0.trace.json.gz") and trace in stopped.text
    assert {"aten::mm", "aten::embedding"} & _ops(server.trace_dir / trace)
    assert _post(server, "/stop_profile").status_code == 400  # nothing running now


@pytest.mark.parametrize("body, field", [
    ({"start_step": 2}, "start_step"), ({"profile_by_stage": True}, "profile_by_stage"),
    ({"activities": ["TPU"]}, "activities.0"), ({"activities": []}, "activities"), ({"num_steps": 0}, "num_steps"),
    ({"activities": ["GPU"]}, None), ({"output_dir": "/proc/no/such/dir"}, "output_dir"),
    ({"output_dir": "../outside"}, "output_dir"), ({"profile_prefix": "../x"}, "profile_prefix")])
def test_bad_profile_requests_are_400(server, body, field):
    r = _post(server, "/start_profile", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["param"] == field, r.json()
    assert _post(server, "/stop_profile").status_code == 400  # no profile was left running


def test_unwritable_output_dir_is_400(server):
    (server.trace_dir / "a-file").write_text("")
    r = _post(server, "/start_profile", json={"output_dir": "a-file/traces"})  # under the directory, not writable
    assert r.status_code == 400 and "not a writable directory" in r.json()["message"], r.text
    assert _post(server, "/stop_profile").status_code == 400


def test_remote_clients_cannot_profile(server):
    """Without --admin-api-key the admin endpoints refuse a client that is not on loopback, as a reverse proxy on
    loopback names it (uvicorn trusts 127.0.0.1's X-Forwarded-For), and a web page that reached localhost under its
    own name (DNS rebinding: the Host header)."""
    for headers in ({"X-Forwarded-For": "10.0.0.5"}, {"Host": "evil.example:30000"}):
        for path in ("/start_profile", "/stop_profile", "/flush_cache"):
            r = _post(server, path, headers=headers)
            assert r.status_code == 403 and "--admin-api-key" in r.json()["message"], (path, r.text)
        assert _post(server, "/generate", headers=headers, json={"input_ids": [5], "sampling_params": {
            "max_new_tokens": 1}}).status_code == 200  # the other endpoints serve it
    assert _post(server, "/stop_profile").status_code == 400  # nothing was started


def test_bench_serving_profile(server):
    port = server.base_url.rsplit(":", 1)[1]
    client_dir = server.trace_dir / "bench"  # the client's directory wins, as upstream (under the server's)
    env = {**os.environ, "SGLANG_TORCH_PROFILER_DIR": str(client_dir)}
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--dataset-name", "random",
           "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4", "--port", port,
           "--disable-tqdm", "--profile", "--profile-prefix", "bench"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (trace,) = _traces(client_dir)
    assert trace.startswith("bench-") and "Stop profiling" in proc.stdout and trace in proc.stdout
    assert "Successful requests:                     4" in proc.stdout
    steps = _post(server, "/start_profile", json={"output_dir": str(client_dir / "steps"), "num_steps": 2})
    assert steps.status_code == 200
    _post(server, "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}})
    assert len(_traces(client_dir / "steps")) == 1  # it stopped by itself after 2 steps
    assert _post(server, "/stop_profile").status_code == 400
