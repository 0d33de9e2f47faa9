"""The prefix cache through the server: a repeated chat reports usage.prompt_tokens_details.cached_tokens (and
/generate meta_info.cached_tokens), Prometheus shows sglang:cache_hit_rate, /flush_cache is refused (400) while a
request runs and empties the cache when idle; --disable-radix-cache reports no cached tokens."""

from __future__ import annotations

import re

import httpx

from server_process import launch

ARGS = ["--model-path", "tiny-deepseek-v4", "--device", "cpu", "--max-total-tokens", "4096", "--enable-metrics",
        "--page-size", "128"]
CHAT = {"model": "tiny-deepseek-v4", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "You are a careful assistant. " * 60},
                     {"role": "user", "content": "Say hello."}]}


def test_cached_tokens_metrics_and_flush(tmp_path):
    server = launch(ARGS, str(tmp_path), timeout=180)
    try:
        url = server.base_url
        first = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).json()
        second = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < second["usage"]["prompt_tokens"]
        assert second["choices"][0]["message"] == first["choices"][0]["message"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        rate = float(re.search(r'sglang:cache_hit_rate\{[^}]*\} ([0-9.e+-]+)', metrics).group(1))
        assert rate > 0

        # a streamed request is running once its first token arrives; leaving the stream then aborts it (the server
        # frees its pages) instead of waiting for its 400 tokens
        with httpx.stream("POST", f"{url}/generate", timeout=120, json={
                "text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
            lines = r.iter_lines()  # kept: a line iterator collected early closes the response (a disconnect)
            assert next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(f"{url}/flush_cache", timeout=10)
        assert busy.status_code == 400 and "running" in busy.text
        server.wait_pools_free()
        ok = httpx.post(f"{url}/flush_cache", timeout=10)
        assert ok.status_code == 200 and ok.text == "Cache flushed\n"
        again = httpx.post(f"{url}/generate", timeout=60,
                           json={"input_ids": [5] * 40, "sampling_params": {"max_new_tokens": 2}}).json()
        assert again["meta_info"]["cached_tokens"] == 0
    finally:
        server.stop()


def test_disabled_cache_reports_nothing(tmp_path):
    server = launch([*ARGS, "--disable-radix-cache"], str(tmp_path), timeout=180)
    try:
        for _ in range(2):
            out = httpx.post(f"{server.base_url}/v1/chat/completions", json=CHAT, timeout=60).json()
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert "disabled" in httpx.post(f"{server.base_url}/flush_cache", timeout=10).text
    finally:
        server.stop()


def test_scheduler_answers_a_flush_it_refuses():
    """The scheduler answers every FlushCacheReq: a refusal (requests still running there, which the HTTP side may
    not know of yet) comes back as a 400 instead of the 200 "Cache flushed" the HTTP side used to answer alone."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import ControlOutput, FlushCacheReq
    from sglang.srt.managers.scheduler_process import SchedulerProcess

    proc = object.__new__(SchedulerProcess)
    proc.dp_rank, answers = 0, {}
    for busy in (True, False):
        proc.scheduler = SimpleNamespace(flush_cache=lambda busy=busy: not busy)
        proc._receive = lambda block, busy=busy: [(FlushCacheReq(f"r{busy}"), None, None)]
        (answers[busy],) = proc._handle_messages(block=False)
    assert answers[False] == ControlOutput("rFalse", 200, "Cache flushed")
    assert answers[True].status_code == 400 and "requests are running" in answers[True].message


def test_scheduler_answers_a_storage_clear():
    """/clear_hicache_storage_backend's message: 200 with upstream's text once the files are deleted, 400 with the
    scheduler's reason when there are none to delete."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import ClearHiCacheReq, ControlOutput
    from sglang.srt.managers.scheduler_process import SchedulerProcess

    proc = object.__new__(SchedulerProcess)
    proc.dp_rank, proc._receive = 0, lambda block: [(ClearHiCacheReq("c"), None, None)]
    proc.scheduler = SimpleNamespace(clear_hicache_storage=lambda: None)
    cleared = ControlOutput("c", 200, "Hierarchical cache storage backend cleared.")
    assert proc._handle_messages(block=False) == [cleared]
    proc.scheduler = SimpleNamespace(clear_hicache_storage=lambda: "no storage backend")
    assert proc._handle_messages(block=False) == [ControlOutput("c", 400, "no storage backend")]
