"""A real server (the built-in tiny model) keeps serving when one request is bad or fails: bad sampling values are a
400 naming the field, a tiny temperature is greedy, and a request whose model step fails gets a 500 (an error event
when streaming) while the requests running beside it finish with their usual output. /health turns 503 after
consecutive failed steps and back to 200 once a step serves.

Failures are injected without any hook in the server's code: a sitecustomize module on the server's PYTHONPATH
(imported by the HTTP process and the spawned scheduler process at start-up) wraps the sampler so that it raises
for prompts starting with MARK (the token after MARK is how many output tokens such a request gets first), and for
every request while the file BROKEN exists (a device that stopped working).
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from server_process import launch

MODEL = "tiny-deepseek-v4"
MARK = [11, 22, 33]
POISON = """
import os

import sglang.srt.layers.sampler as _sampler

_real_sample, _real_sample_async = _sampler.sample, _sampler.sample_async


def _check(reqs):
    if os.path.exists(os.path.join(os.path.dirname(__file__), "BROKEN")):
        raise RuntimeError("injected test failure: the device is broken")
    for req in reqs:
        ids = req.origin_input_ids
        if ids[:3] == MARK and len(req.output_ids) >= ids[3]:
            raise RuntimeError("injected test failure")


def _poisoned_sample(logits, reqs, grammar=None):
    _check(reqs)
    return _real_sample(logits, reqs, grammar)


def _poisoned_sample_async(logits, reqs, grammar=None):  # overlapped decode steps
    _check(reqs)
    return _real_sample_async(logits, reqs, grammar)


_sampler.sample, _sampler.sample_async = _poisoned_sample, _poisoned_sample_async
"""
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = [[100 + i, 7, 900 + 3 * i, 42, 5000 + i, 13] * (i + 1) for i in range(4)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    site = tmp_path_factory.mktemp("poison")
    (site / "sitecustomize.py").write_text(f"MARK = {MARK!r}\n" + POISON)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        handle = launch(["--model-path", MODEL, "--max-running-requests", "16", "--chunked-prefill-size", "64",
                         "--context-length", "512"], str(tmp_path_factory.mktemp("server")))
    handle.broken_flag = site / "BROKEN"
    yield handle
    handle.stop()


def poison(fail_after: int) -> list:
    return MARK + [fail_after, 500, 600, 700]


def generate(base: str, input_ids: list, params: dict = GREEDY, **kw) -> httpx.Response:
    return httpx.post(f"{base}/generate", json={"input_ids": input_ids, "sampling_params": params, **kw}, timeout=60)


def raw_json(base: str, path: str, body: str) -> httpx.Response:
    """A body with NaN / Infinity literals (Python's json accepts them; httpx refuses to encode them)."""
    return httpx.post(f"{base}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)


def error_message(r: httpx.Response) -> str:
    body = r.json()
    assert body["object"] == "error" and body["code"] == r.status_code, body
    return body["message"]


def test_non_finite_sampling_values_are_400_naming_the_field(server):
    base = server.base_url
    for value in ("NaN", "Infinity", "-Infinity"):
        r = raw_json(base, "/generate", f'{{"input_ids": [5, 6, 7], "sampling_params": {{"temperature": {value}}}}}')
        assert r.status_code == 400 and "temperature" in error_message(r)
    r = raw_json(base, "/generate", '{"input_ids": [5, 6, 7], "sampling_params": {"top_p": NaN}}')
    assert r.status_code == 400 and "top_p" in error_message(r)
    r = generate(base, [5, 6, 7], {"seed": 2**70})
    assert r.status_code == 400 and "seed" in error_message(r)
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": [5, 6], "seed": 2**64, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400 and "seed" in error_message(r)
    assert generate(base, [5, 6, 7], {"seed": 2**64 - 1, "max_new_tokens": 2}).status_code == 200


def test_tiny_temperature_on_chat_is_greedy(server):
    def chat(temperature: float) -> dict:
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
            "temperature": temperature, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    tiny, greedy = chat(1e-40), chat(0)
    assert tiny["usage"]["completion_tokens"] == 8
    assert tiny["choices"][0]["message"] == greedy["choices"][0]["message"]


def test_concurrent_requests_survive_a_failing_one(server):
    base = server.base_url
    solo = [generate(base, ids).json()["output_ids"] for ids in PROMPTS]

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            async def post(path, body):
                return await client.post(path, json=body)

            async def stream(path, body):
                async with client.stream("POST", path, json=body) as r:
                    return r.status_code, [line async for line in r.aiter_lines() if line.startswith("data: ")]

            good = [post("/generate", {"input_ids": ids, "sampling_params": GREEDY}) for ids in PROMPTS[:2]]
            good.append(stream("/generate", {"input_ids": PROMPTS[2], "sampling_params": GREEDY, "stream": True}))
            good.append(post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 10,
                                                 "temperature": 0, "ignore_eos": True}))
            bad = [post("/generate", {"input_ids": poison(2), "sampling_params": GREEDY}),
                   stream("/generate", {"input_ids": poison(2), "sampling_params": GREEDY, "stream": True}),
                   post("/v1/completions", {"model": MODEL, "prompt": poison(1), "max_tokens": 10, "temperature": 0}),
                   stream("/v1/completions", {"model": MODEL, "prompt": poison(2), "max_tokens": 10,
                                              "temperature": 0, "stream": True}),
                   post("/generate", {"input_ids": [5, 6], "sampling_params": {"seed": -(2**63) - 1}})]
            return await asyncio.gather(*good, *bad)

    g0, g1, g2, g3, bad_gen, bad_gen_stream, bad_cmpl, bad_cmpl_stream, bad_seed = asyncio.run(run())
    assert [g0.json()["output_ids"], g1.json()["output_ids"]] == solo[:2]
    status, events = g2
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["output_ids"] == solo[2]
    assert g3.status_code == 200 and g3.json()["usage"]["completion_tokens"] == 10
    assert g3.json()["choices"][0]["text"] == generate(base, PROMPTS[3]).json()["text"]
    for r in (bad_gen, bad_cmpl):
        assert r.status_code == 500 and "internal error" in error_message(r)
    for status, events in (bad_gen_stream, bad_cmpl_stream):
        assert status == 200 and events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: "):])["error"]
        assert error["code"] == 500 and "internal error" in error["message"]
    assert json.loads(bad_gen_stream[1][0][len("data: "):])["output_ids"]  # tokens were streamed before it failed
    assert bad_seed.status_code == 400 and "seed" in error_message(bad_seed)
    server.wait_pools_free()
    assert httpx.get(f"{base}/health").status_code == 200


def test_health_is_503_while_every_step_fails_and_200_once_one_serves(server):
    from sglang.srt.managers.io_struct import UNHEALTHY_AFTER_FAILED_STEPS

    base = server.base_url

    def failed_steps() -> int:
        return server.server_info()["scheduler_stats"]["consecutive_failed_steps"]

    # Requests that fail alone make steps that serve nobody, but the server can serve: /health's probe says so.
    for _ in range(UNHEALTHY_AFTER_FAILED_STEPS):
        assert generate(base, poison(0)).status_code == 500
    assert failed_steps() == UNHEALTHY_AFTER_FAILED_STEPS
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200 and failed_steps() == 0
    # A device that fails every step takes the server out of rotation ...
    server.broken_flag.write_text("")
    try:
        for i in range(UNHEALTHY_AFTER_FAILED_STEPS):
            assert httpx.get(f"{base}/health", timeout=30).status_code == 200
            r = generate(base, PROMPTS[0])
            assert r.status_code == 500 and "internal error" in error_message(r)
        assert httpx.get(f"{base}/health", timeout=30).status_code == 503
        assert httpx.get(f"{base}/health_generate", timeout=60).status_code == 503
        assert httpx.get(f"{base}/health", timeout=30).status_code == 503
    finally:
        server.broken_flag.unlink()
    # ... until a step serves again (here /health's own probe).
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200 and failed_steps() == 0
    server.wait_pools_free()
