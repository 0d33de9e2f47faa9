"""Prefill/decode disaggregation end to end: a prefill server and a decode server (--disaggregation-mode; Mooncake's TCP
transport on loopback, then NIXL's UCX, a cluster each) behind the real sglang-router in its PD mode give the greedy
outputs of one co-located server for /generate, chat, streaming, a forced tool call and a json_schema output, all
under speculative decoding (both servers run MTP: they must pool alike); the servers report their role and transfers;
a malformed bootstrap room is a 400; a killed prefill server fails only the requests waiting for it (5xx) and the
decode server's pools come back free. Three servers start in parallel (about 90 s on two busy cores); the tests then
take about 60 s, most of it the chat test's constrained decoding on three servers."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from server_process import free_port, launch, launch_pd_router

# The transfer engines both servers run, each a cluster of its own; the test extra installs both packages.
ENGINES = {"mooncake": ("mooncake.engine", "mooncake-transfer-engine-non-cuda"),
           "nixl": ("nixl_cu12._api", "nixl-cu12")}
pytest.importorskip("sglang_router", reason="the test extra installs sglang-router")

MODEL = "tiny-deepseek-v4"
COMMON = ["--model-path", MODEL, "--context-length", "1024", "--max-running-requests", "8", "--enable-metrics",
          "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2"]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


class Cluster:
    def __init__(self, tmp: str, backend: str) -> None:
        self.bootstrap_port = free_port()
        self.hang_file = os.path.join(tmp, "hang-prefill")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            backend = ["--disaggregation-transfer-backend", backend]
            prefill = pool.submit(launch, [*COMMON, *backend, "--disaggregation-mode", "prefill",
                                           "--disaggregation-bootstrap-port", str(self.bootstrap_port)], tmp, 240,
                                  {"SGLANG_TEST_HANG_SCHEDULER_FILE": self.hang_file})
            decode = pool.submit(launch, [*COMMON, *backend, "--disaggregation-mode", "decode"], tmp, 240)
            colocated = pool.submit(launch, COMMON, tmp, 240)
            self.prefill, self.decode, self.colocated = prefill.result(), decode.result(), colocated.result()
        self.router = launch_pd_router(self.prefill.base_url, self.bootstrap_port, self.decode.base_url, tmp)
        self.url = self.router.base_url

    def stop(self) -> None:
        self.router.stop()
        for handle in (self.prefill, self.decode, self.colocated):
            if handle.proc.poll() is None:
                handle.stop()


@pytest.fixture(scope="module", params=sorted(ENGINES))
def cluster(request, tmp_path_factory):
    module, package = ENGINES[request.param]
    pytest.importorskip(module, reason=f"the test extra installs {package}")
    c = Cluster(str(tmp_path_factory.mktemp("pd")), request.param)
    yield c
    c.stop()


def both(cluster, path: str, body: dict) -> tuple:
    """The same request through the router (disaggregated) and to the co-located server."""
    pd = httpx.post(f"{cluster.url}{path}", json=body, timeout=120)
    ref = httpx.post(f"{cluster.colocated.base_url}{path}", json=body, timeout=120)
    assert pd.status_code == 200 and ref.status_code == 200, (pd.text, ref.text)
    return pd.json(), ref.json()


def test_generate_matches_colocated_with_speculative_decoding(cluster):
    """About 10 s. Prompts shorter and longer than the window, not multiples of the compression ratios."""
    for n in (11, 70):
        ids = [(37 * i + n) % 120000 + 5 for i in range(n)]
        pd, ref = both(cluster, "/generate", {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True})
        assert pd["output_ids"] == ref["output_ids"] and len(pd["output_ids"]) == 8
        assert pd["meta_info"]["spec_accept_length"] >= 1
        # the prefill server's prompt logprobs, merged by the router (which rounds them to f32), are the co-located
        # ones: the decode server adds none
        merged, want = pd["meta_info"]["input_token_logprobs"], ref["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in merged] == [t for _, t, _ in want]
        assert all(abs(a - b) < 1e-4 for (a, _, _), (b, _, _) in zip(merged, want) if b is not None)
        got = [lp for lp, _, _ in pd["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def test_chat_streaming_tool_call_and_json_schema_match_colocated(cluster):
    """About 45 s (grammars compile on three servers)."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat = {"model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0}
    pd, ref = both(cluster, "/v1/chat/completions", chat)
    assert pd["choices"][0]["message"] == ref["choices"][0]["message"]

    def streamed(url: str) -> str:
        text = ""
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**chat, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        return text
    assert streamed(cluster.url) == streamed(cluster.colocated.base_url) != ""

    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    # the forced call's grammar constrains the decode side as it does a co-located server (the random model
    # writes no complete call in 40 tokens: the text so far, cut at the same token, is compared)
    pd, ref = both(cluster, "/v1/chat/completions", {**chat, "max_tokens": 40, "tools": tools,
                                                     "tool_choice": "required"})
    assert pd["choices"][0]["message"] == ref["choices"][0]["message"]
    assert pd["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"] > 5

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    pd, ref = both(cluster, "/v1/chat/completions", {**chat, "max_tokens": 30, "response_format": fmt})
    assert pd["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert json.loads(pd["choices"][0]["message"]["content"])["answer"] in ("yes", "no")


def test_roles_transfers_and_malformed_rooms(cluster):
    """About 1 s. /server_info names each server's role and counts the transfers; a malformed or missing room is a
    400 naming the field."""
    prefill, decode = cluster.prefill.server_info(), cluster.decode.server_info()
    assert (prefill["disaggregation_mode"], decode["disaggregation_mode"]) == ("prefill", "decode")
    assert prefill["disaggregation_bootstrap_port"] == cluster.bootstrap_port
    sent, received = prefill["scheduler_stats"]["transfer"], decode["scheduler_stats"]["transfer"]
    assert sent["num_transfers"] >= 4 and sent["bytes"] == received["bytes"] > 0
    assert prefill["scheduler_stats"]["transfer_queues"] == {"role": "prefill", "waiting": 0, "transferring": 0}
    for server in (cluster.prefill, cluster.decode):
        for room in ("abc", -1, 2**63):
            r = httpx.post(f"{server.base_url}/generate", json={
                "input_ids": [5, 6], "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": cluster.bootstrap_port, "bootstrap_room": room}, timeout=30)
            assert r.status_code == 400 and "bootstrap_room" in r.text, r.text
    metrics = httpx.get(f"{cluster.decode.base_url}/metrics", timeout=10).text
    assert "sglang:num_decode_transfer_queue_reqs" in metrics and "sglang:kv_transfer_bytes_total" in metrics


def test_killed_prefill_fails_only_its_waiting_requests(cluster):
    """About 2 s; runs last (it kills the prefill server). Two requests whose prefill hangs, then dies, get a 5xx;
    the decode server's pools are free afterwards, and it stays healthy and serving."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        open(cluster.hang_file, "w").close()  # the prefill scheduler stops before its next step
        waiting = [pool.submit(httpx.post, f"{cluster.url}/generate", json={
            "input_ids": [20 + i] * 30, "sampling_params": GREEDY}, timeout=120) for i in range(2)]
        until(lambda: cluster.decode.server_info()["scheduler_stats"]["transfer_queues"]["transferring"] == 2,
              "rooms waiting for their prefill")
        os.kill(cluster.prefill.proc.pid, signal.SIGKILL)  # its scheduler process dies with it
        for fut in waiting:
            assert fut.result().status_code >= 500, fut.result().text
    cluster.decode.wait_pools_free()
    assert httpx.get(f"{cluster.decode.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{cluster.decode.base_url}/health_generate", timeout=60).status_code == 200
    cluster.decode.wait_pools_free()


def until(fn, what: str, timeout: float = 60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")
