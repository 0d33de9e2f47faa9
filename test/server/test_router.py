"""Two co-located servers behind the real sglang-router (`python -m sglang_router.launch_router`, regular mode): what
the router calls on a worker (/health, /server_info, /model_info at registration; /get_load for its load figures;
/metrics for /engine_metrics) is answered, /generate and /v1/chat/completions, plain and streamed, come back as a
replica alone gives them, a client leaving mid-stream frees the replica's pages, and a replica killed mid-stream
fails only what it was serving: the router then sends the next requests to the survivor (after its retries and
circuit breaker, see docs/router.md). One router and two servers for the module (about 40 s on 2 cores); the two
in-process tests take under a second."""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from server_process import launch, launch_router
from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.managers.io_struct import SchedulerStats
from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.server_args import ServerArgs

ARGS = ["--model-path", "tiny-deepseek-v4", "--device", "cpu", "--max-total-tokens", "4096", "--enable-metrics",
        "--page-size", "128"]
CHAT = {"model": "tiny-deepseek-v4", "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": "Name three rivers."}]}
GENERATE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


def group_stats(dp_rank: int, running: int, waiting: int, usage: float) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, token_usage=usage,
                          num_generated_tokens=0, dp_rank=dp_rank)


def test_get_load_reports_each_data_parallel_group():
    """The router's load poll: one entry per DP group, num_tokens = the KV cache in use."""
    groups = {1: group_stats(1, 2, 1, 0.5), 0: group_stats(0, 1, 0, 0.25)}
    tm = SimpleNamespace(group_stats=groups, last_stats=SchedulerStats.merge(list(groups.values())),
                         ready=SimpleNamespace(max_total_tokens=4096))
    client = TestClient(create_app(tm, ServerArgs(model_path="m")))
    assert client.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 1024},
        {"dp_rank": 1, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 2048}]
    tm.group_stats, tm.last_stats = {}, group_stats(0, 0, 0, 0.0)  # before the scheduler's first step
    assert client.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_every_metric_family_has_a_sample_from_start():
    """The router merges the replicas' families by label names; a family still empty on one replica (idle, or
    without speculative decoding) has none and fails its /engine_metrics."""
    text = MetricsCollector("m").render().decode()
    families = re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M)
    assert len(families) > 10
    for name, kind in families:
        sample = name + ("_count" if kind == "histogram" else "")
        if kind == "counter" and not name.endswith("_total"):
            sample += "_total"
        assert re.search(rf'^{re.escape(sample)}\{{([^}}]*,)?model_name="m"[,}}]', text, re.M), name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("router"))
    with ThreadPoolExecutor(2) as pool:  # both replicas load at once
        starts = [pool.submit(launch, ARGS, tmp, 180) for _ in range(2)]
    servers = [s.result() for s in starts if s.exception() is None]
    router = None
    try:
        assert len(servers) == 2, [s.exception() for s in starts]
        router = launch_router([s.base_url for s in servers], ["--policy", "round_robin"], tmp)
        yield SimpleNamespace(servers=servers, router=router)
    finally:
        for proc in ([router] if router else []) + servers:
            proc.stop()


def generate(url: str, stream: bool = False) -> dict:
    if not stream:
        return httpx.post(f"{url}/generate", json=GENERATE, timeout=60).json()
    with httpx.stream("POST", f"{url}/generate", json={**GENERATE, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return chunks[-1]


def chat(url: str, stream: bool = False) -> str:
    if not stream:
        out = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).json()
        return out["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_router_output_is_a_replica_output(cluster):
    alone = cluster.servers[0].base_url
    want_gen, want_chat = generate(alone), chat(alone)
    assert want_gen["meta_info"]["completion_tokens"] == 6 and want_chat
    for _ in range(2):  # round robin: each replica once
        for stream in (False, True):
            got = generate(cluster.router.base_url, stream)
            assert (got["text"], got["output_ids"]) == (want_gen["text"], want_gen["output_ids"])
            assert chat(cluster.router.base_url, stream) == want_chat
    served = [httpx.get(f"{s.base_url}/metrics", timeout=10).text for s in cluster.servers]
    assert all(re.search(r'sglang:num_requests_total\{model_name="tiny-deepseek-v4"\} [1-9]', m) for m in served)

    loads = httpx.get(f"{cluster.router.base_url}/get_loads", timeout=10).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(s.base_url for s in cluster.servers)
    assert all(w["load"] >= 0 for w in loads), loads  # -1: the router could not read a replica's /get_load
    assert httpx.get(f"{cluster.router.base_url}/engine_metrics", timeout=10).status_code == 200


def start_long_stream(router_url: str):
    """A streamed request through the router, open and running (its first token read)."""
    stream = httpx.stream("POST", f"{router_url}/generate", timeout=60, json={
        "text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})
    response = stream.__enter__()
    lines = response.iter_lines()
    assert response.status_code == 200 and next(line for line in lines if line.startswith("data: "))
    return stream, lines


def test_client_leaving_through_the_router_frees_the_replica(cluster):
    stream, _ = start_long_stream(cluster.router.base_url)
    stream.__exit__(None, None, None)  # the router drops its upstream connection: the replica aborts the request
    for server in cluster.servers:
        server.wait_pools_free()


def test_killed_replica_fails_only_its_requests(cluster):
    """Runs last: it kills one replica."""
    stream, lines = start_long_stream(cluster.router.base_url)
    busy = [s for s in cluster.servers if s.server_info()["scheduler_stats"]["num_running_reqs"]]
    assert len(busy) == 1
    victim, survivor = busy[0], next(s for s in cluster.servers if s is not busy[0])
    victim.proc.send_signal(signal.SIGKILL)
    with pytest.raises(httpx.RemoteProtocolError):  # the router cuts the client's stream (no error event)
        for _ in lines:
            pass
    stream.__exit__(None, None, None)
    victim.proc.wait(timeout=20)

    # Requests the router still sends to the dead replica fail (500, after its retries) until its circuit breaker
    # opens; from then on the survivor serves every one.
    codes = [httpx.post(f"{cluster.router.base_url}/generate", json=GENERATE, timeout=60).status_code
             for _ in range(6)]
    assert set(codes) <= {200, 500} and codes[-3:] == [200] * 3, codes
    survivor.wait_pools_free()
