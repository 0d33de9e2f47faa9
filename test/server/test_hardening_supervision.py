"""A real server (the built-in tiny model) under clients that stall or flood it: a scheduler that hangs while alive
turns /health to 503 within --watchdog-timeout, fails every request awaiting it with a 503 naming the watchdog and
frees them once it goes on; a full queue (--max-queued-requests) answers 429 with Retry-After; a streaming client that
stops reading is cut off and its request aborted, its pages freed. The scheduler is hung through the test hook
SGLANG_TEST_HANG_SCHEDULER_FILE (it hangs before each step while that file exists). The same behaviours over a fake
scheduler, exactly: test_supervision.py."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import httpx
import pytest

from server_process import launch

MODEL = "tiny-deepseek-v4"
WATCHDOG_S = 3
MAX_RUNNING, MAX_QUEUED = 8, 2
BUFFERED_TOKENS = 8  # the cut-off bound of the queue server (a sitecustomize lowers MAX_BUFFERED_TOKENS)
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def hung_server(tmp_path_factory, args: list, site: str = ""):
    tmp = tmp_path_factory.mktemp("supervision")
    hang = tmp / "HANG"
    path = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    handle = launch(["--model-path", MODEL, *args], str(tmp),
                    env={"SGLANG_TEST_HANG_SCHEDULER_FILE": str(hang), "PYTHONPATH": path})
    handle.hang = hang
    return handle


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    handle = hung_server(tmp_path_factory, ["--watchdog-timeout", str(WATCHDOG_S)])
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text("import sglang.srt.managers.tokenizer_manager as tm\n"
                                           f"tm.MAX_BUFFERED_TOKENS = {BUFFERED_TOKENS}\n")
    handle = hung_server(tmp_path_factory, ["--max-running-requests", str(MAX_RUNNING), "--max-queued-requests",
                                            str(MAX_QUEUED)], str(site))
    yield handle
    handle.stop()


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what} not seen after {timeout} s"
        time.sleep(0.2)


def health(base: str) -> int:
    return httpx.get(f"{base}/health", timeout=30).status_code


def test_a_hung_scheduler_turns_health_503_and_fails_its_requests(watched):
    base = watched.base_url
    assert httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY},
                      timeout=60).status_code == 200

    async def run():
        long = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            async with client.stream("POST", "/generate", json={"input_ids": [8, 9, 10], "sampling_params": long,
                                                                "stream": True}) as r:
                events = (line async for line in r.aiter_lines() if line.startswith("data: "))
                first = await events.__anext__()  # it runs ...
                watched.hang.write_text("")  # ... and the scheduler hangs before its next step
                beside = asyncio.create_task(client.post("/generate", json={"input_ids": [11, 12],
                                                                            "sampling_params": long}))
                rest = [line async for line in events]
            return first, rest, await beside

    try:
        first, rest, beside = asyncio.run(run())
        assert json.loads(first[len("data: "):])["output_ids"]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == 503 and "--watchdog-timeout" in error["message"], error
        assert beside.status_code == 503 and "--watchdog-timeout" in beside.json()["message"], beside.text
        wait_for(lambda: health(base) == 503, "/health 503")
        refused = httpx.post(f"{base}/generate", json={"input_ids": [5, 6], "sampling_params": GREEDY}, timeout=60)
        assert refused.status_code == 503 and "--watchdog-timeout" in refused.json()["message"], refused.text
    finally:
        watched.hang.unlink(missing_ok=True)
    # the scheduler goes on: the aborted requests are freed, and the server serves again
    wait_for(lambda: health(base) == 200, "/health 200 again")
    watched.wait_pools_free(timeout=120)
    ok = httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4


def test_a_full_queue_answers_429_with_retry_after(bounded):
    """With the scheduler hung nothing finishes, so of MAX_RUNNING + MAX_QUEUED + 2 requests sent at once exactly the
    last two to arrive are refused, whatever the order they arrive in."""
    base, capacity = bounded.base_url, MAX_RUNNING + MAX_QUEUED

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            tasks = [asyncio.create_task(client.post("/generate", json={"input_ids": [5, 6, 7 + i],
                                                                        "sampling_params": GREEDY}))
                     for i in range(capacity + 2)]
            done: set = set()
            while len(done) < 2:
                finished, _ = await asyncio.wait(set(tasks) - done, return_when=asyncio.FIRST_COMPLETED)
                done |= finished
            refused = [t.result() for t in done]
            streamed = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                                  "stream": True})
            bounded.hang.unlink()
            return refused, streamed, await asyncio.gather(*(t for t in tasks if t not in done))

    bounded.hang.write_text("")
    try:
        refused, streamed, served = asyncio.run(run())
    finally:
        bounded.hang.unlink(missing_ok=True)
    for r in [*refused, streamed]:
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        err = r.json()
        assert err["type"] == "RateLimitError" and "--max-queued-requests" in err["message"], err
    assert [r.status_code for r in served] == [200] * capacity
    bounded.wait_pools_free()


def read_chunked_events(sock: socket.socket) -> list:
    """The SSE events of a whole HTTP/1.1 chunked response read from `sock` (until the server closes it)."""
    data = b""
    while chunk := sock.recv(1 << 20):
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
    payload = b""
    while True:
        size, body = body.split(b"\r\n", 1)
        if int(size, 16) == 0:
            break
        payload, body = payload + body[:int(size, 16)], body[int(size, 16) + 2:]
    return [json.loads(e[len("data: "):]) if e != "data: [DONE]" else e
            for e in payload.decode().split("\n\n") if e.startswith("data: ")]


def test_a_streaming_client_that_stops_reading_is_cut_off(bounded):
    """8 streams whose every event carries its prompt's 900 logprobs: the socket's buffers fill after a few steps,
    then BUFFERED_TOKENS more wait in the server and the requests are aborted, long before max_new_tokens; the pools
    are free while the client has still read nothing."""
    base, max_new = bounded.base_url, 100
    prompts = [[100 + i] + [(7 * i + 13 * j) % 5000 + 10 for j in range(899)] for i in range(MAX_RUNNING)]
    body = json.dumps({"input_ids": prompts, "stream": True, "return_logprob": True, "logprob_start_len": 0,
                       "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}})
    before = bounded.server_info()["scheduler_stats"]["num_generated_tokens"]
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing buffers little
    sock.settimeout(300)
    try:
        sock.connect((host, int(port)))
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())

        def cut_off() -> bool:
            stats = bounded.server_info()["scheduler_stats"]
            return (stats["num_generated_tokens"] >= before + MAX_RUNNING and stats["pools_all_free"]
                    and not stats["num_running_reqs"] and not stats["num_waiting_reqs"])

        wait_for(cut_off, "the requests generating, then aborted with their pages freed", timeout=300)
        events = read_chunked_events(sock)  # only now does the client read
    finally:
        sock.close()
    assert events[-1] == "data: [DONE]"
    error = events[-2]["error"]
    assert error["code"] == 408 and "did not read its stream" in error["message"], error
    assert all(len(e["output_ids"]) < max_new for e in events[:-2])
    bounded.wait_pools_free()
