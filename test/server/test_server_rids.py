"""Client request ids on a real server: /generate's rid, /abort_request by rid or all, and a rid retried at once after
its client dropped the request."""

from __future__ import annotations

import time

import httpx
import pytest

from server_process import launch

MODEL = "tiny-deepseek-v4"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = launch(["--model-path", MODEL, "--max-running-requests", "16", "--context-length", "1024"],
                    str(tmp_path_factory.mktemp("rids")))
    yield handle
    handle.stop()


def test_fresh_server_reports_scheduler_stats(server):
    """Before any request (this module's first test), /server_info has the scheduler's stats from its start."""
    stats = server.server_info()["scheduler_stats"]
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0 and stats["pools_all_free"]
    assert stats["num_generated_tokens"] == 0


def test_abort_request_by_rid_and_all(server):
    """/generate's rid is the request's id; /abort_request ends that request (and the samples of an n > 1 request
    that gave it), or every request, with its output so far and finish_reason abort; duplicate or malformed rids are
    400s; the pools come back free."""
    from concurrent.futures import ThreadPoolExecutor

    base, long = server.base_url, {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0}

    def post(path, body):
        return httpx.post(f"{base}{path}", json=body, timeout=120)

    def wait_running(k):
        for _ in range(200):
            if (server.server_info().get("scheduler_stats") or {}).get("num_running_reqs", 0) >= k:
                return
            time.sleep(0.05)
        raise AssertionError(f"{k} requests never ran")

    with ThreadPoolExecutor(4) as pool:
        one = pool.submit(post, "/generate", {"text": "hello", "sampling_params": long, "rid": "job-1"})
        samples = pool.submit(post, "/generate", {"input_ids": [5, 6], "sampling_params": {**long, "n": 2},
                                                  "rid": "job-2"})
        wait_running(3)
        dup = post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}, "rid": "job-1"})
        assert dup.status_code == 400 and dup.json()["param"] == "rid"
        assert post("/abort_request", {"rid": "job-1"}).json() == {"aborted": ["job-1"]}
        out = one.result()
        assert out.status_code == 200 and out.json()["meta_info"]["id"] == "job-1"
        assert out.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < out.json()["meta_info"]["completion_tokens"] < 900
        assert sorted(post("/abort_request", {"rid": "job-2"}).json()["aborted"]) == ["job-2-0", "job-2-1"]
        assert [o["meta_info"]["finish_reason"]["type"] for o in samples.result().json()] == ["abort", "abort"]
        chat = pool.submit(post, "/v1/chat/completions", {"model": MODEL, "max_tokens": 900, "ignore_eos": True,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        wait_running(1)
        assert len(post("/abort_request", {"abort_all": True}).json()["aborted"]) == 1
        assert chat.result().json()["choices"][0]["finish_reason"] == "abort"
    assert post("/abort_request", {"rid": "job-1"}).json() == {"aborted": []}  # finished: nothing to abort
    for body in ({}, {"rid": ""}):
        assert post("/abort_request", body).status_code == 400
    for rid in ("", ["a", "a"], ["a"], 5):
        bad = post("/generate", {"input_ids": [[5], [6]], "sampling_params": {"max_new_tokens": 1}, "rid": rid})
        assert bad.status_code == 400 and bad.json()["param"].startswith("rid"), (rid, bad.text)
    for rid in (["a"], ["a", "b"]):  # one prompt: a string
        bad = post("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}, "rid": rid})
        assert bad.status_code == 400 and "a string" in bad.json()["message"], (rid, bad.text)
    server.wait_pools_free()


def test_rid_reused_right_after_a_disconnect(server):
    """A client that drops a non-streaming /generate and retries at once with the same rid is served (the old
    request, whose handler polls for the disconnect, is dropped when the retry asks for its rid); pools come back."""
    base, body = server.base_url, {"text": "hello", "rid": "retry-1",
                                   "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    for _ in range(5):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the request runs
            httpx.post(f"{base}/generate", json=body, timeout=0.3)
        retry = httpx.post(f"{base}/generate", json={**body, "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert retry.status_code == 200, retry.text
        assert retry.json()["meta_info"]["id"] == "retry-1" and retry.json()["meta_info"]["completion_tokens"] == 2
    server.wait_pools_free()
