"""A real server process on loopback (the built-in tiny model), driven by the openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import threading
import time

import httpx
import openai
import pytest

from server_process import launch

MODEL = "tiny-deepseek-v4"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = launch(["--model-path", MODEL, "--reasoning-parser", "deepseek-v4", "--tool-call-parser", "deepseekv4",
                     "--enable-metrics", "--max-running-requests", "64", "--chunked-prefill-size", "256",
                     "--context-length", "1024",
                     # upstream recipe flags: accepted (arg_groups/upstream_recipes.py)
                     "--moe-runner-backend", "marlin", "--disable-flashinfer-autotune", "--tokenizer-worker-num", "2",
                     "--expert-distribution-recorder-mode", "stat"],
                    str(tmp_path_factory.mktemp("server")))
    print(f"server start-up to healthy: {handle.startup_s:.1f} s")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def test_models_info_and_utility_endpoints(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    base = server.base_url
    missing = httpx.get(f"{base}/v1/models/other-model")
    assert missing.status_code == 404 and "other-model" in missing.json()["message"]
    info = httpx.get(f"{base}/model_info").json()
    assert info["is_generation"] and info["context_length"] == 1024
    info = server.server_info()
    assert "growth per token" in info["pool_report"]
    # upstream SGLang's shape; the accept length only with speculative decoding (test_server_speculative.py)
    assert info["internal_states"][0].keys() == {"token_usage"}
    assert httpx.get(f"{base}/health_generate", timeout=60).status_code == 200
    tok = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert httpx.post(f"{base}/detokenize", json={"tokens": tok["tokens"]}).json()["text"] == "Hello world"
    assert httpx.post(f"{base}/flush_cache").status_code == 200
    metrics = httpx.get(f"{base}/metrics").text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
                 "sglang:time_to_first_token_seconds", "sglang:time_per_output_token_seconds"):
        assert name in metrics


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True}, logprobs=3)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(len(t) == 3 for t in lp.top_logprobs)
    batch = client.completions.create(model=MODEL, prompt=["a b", "c d e"], max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert len(batch.choices) == 2 and batch.usage.completion_tokens == 6
    n3 = client.completions.create(model=MODEL, prompt=["a b", "c d e"], max_tokens=3, temperature=0, n=3,
                                   extra_body={"ignore_eos": True})
    assert len(n3.choices) == 6 and n3.usage.completion_tokens == 18
    assert n3.usage.prompt_tokens == batch.usage.prompt_tokens  # each prompt once, whatever n
    ids = client.completions.create(model=MODEL, prompt=[100, 200, 300], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 3
    # a sampled special token (listed in tokens, skipped in the text) moves no later text_offset
    special = client.completions.create(model=MODEL, prompt="数学是", max_tokens=24, temperature=1.0, seed=2,
                                        logprobs=1, extra_body={"ignore_eos": True}).choices[0]
    toks, offs = special.logprobs.tokens, special.logprobs.text_offset
    skipped = [t for t, o in zip(toks, offs) if not special.text.startswith(t, o)]
    assert skipped and all(t.startswith("<｜") or "\ufffd" in t for t in skipped), skipped
    echo = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Echo me")


def test_chat_plain_stream_n_logprobs(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].message.role == "assistant" and plain.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(pieces) == plain.choices[0].message.content
    assert usage.completion_tokens == 8 and usage.prompt_tokens == plain.usage.prompt_tokens
    assert not hasattr(plain.choices[0], "meta_info") or plain.choices[0].meta_info is None
    meta = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "return_meta_info": True})
    info = meta.choices[0].model_extra["meta_info"]  # SGLang's extension, as upstream's chat eval reads it
    assert info["completion_tokens"] == 8 and info["finish_reason"]["type"] == "length"
    assert meta.choices[0].message.content == plain.choices[0].message.content
    assert reasons[-1] == "length"
    two = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=1.0, n=2, seed=3)
    assert len(two.choices) == 2 and two.usage.completion_tokens <= 10
    assert two.usage.prompt_tokens == plain.usage.prompt_tokens  # n > 1: the prompt counts once (as OpenAI)
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=1.0, n=2, seed=3)
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]
    lp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=2, extra_body={"ignore_eos": True})
    content = lp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_chat_thinking_and_tools(client):
    msgs = [{"role": "user", "content": "Think about it"}]
    think = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True,
                                                       "chat_template_kwargs": {"thinking": True}})
    message = think.choices[0].message
    # A random model never closes </think>: everything it wrote is reasoning.
    assert getattr(message, "reasoning_content", None) and not message.content
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    with_tools = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0, tools=tools)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 200  # the tools block is in the prompt


def test_response_format_and_grammars(client):
    """response_format json_schema / json_object and the regex extension constrain the output (random weights,
    temperature 1); a bad schema is a 400 naming the problem."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"},
                                               "score": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["answer", "sure", "score"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Answer in JSON"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=1.0, seed=1, n=3,
                                         response_format=fmt)
    for choice in out.choices:
        value = json.loads(choice.message.content)
        assert value["answer"] in ("yes", "no") and isinstance(value["sure"], bool) and 1 <= value["score"] <= 5
        assert set(value) == {"answer", "sure", "score"} and choice.finish_reason == "stop"
    # json_object: an object (a string the random model never closes may cut it), on /v1/responses and
    # /v1/completions too
    obj = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=1.0, seed=2, n=4,
                                         response_format={"type": "json_object"})
    for choice in obj.choices:
        text = choice.message.content
        assert isinstance(json.loads(text), dict) if choice.finish_reason == "stop" else text.startswith('{"'), text
    resp = client.responses.create(model=MODEL, input="JSON", max_output_tokens=24, temperature=1.0,
                                   text={"format": {"type": "json_object"}})
    assert resp.output_text.startswith("{"), resp.output_text
    comp = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=24, temperature=1.0, seed=4,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert comp.choices[0].text.startswith("{"), comp.choices[0].text
    regex = client.completions.create(model=MODEL, prompt="Pick", max_tokens=20, temperature=1.0, seed=3,
                                      extra_body={"regex": "(left|right) [0-9]{3}"})
    assert re.fullmatch("(left|right) [0-9]{3}", regex.choices[0].text)
    bad = httpx.post(f"{client.base_url}chat/completions", json={
        "model": MODEL, "messages": msgs, "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "x", "schema": {"type": 5}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "json_schema", bad.text


def test_forced_tool_choice(client):
    """tool_choice "required" and a named function (either tool: "required" picks get_weather at seed 5) force one
    DSML call with schema-valid arguments (random weights, temperature 1), as tool_calls, finish_reason tool_calls."""
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 3}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "user", "content": "Weather?"}]
    choices = ("required", *({"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")))

    def ask(choice):
        return client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice=choice,
                                              max_tokens=400, temperature=1.0, seed=5)

    with concurrent.futures.ThreadPoolExecutor(len(choices)) as pool:  # one batch: the two calls share decode steps
        outs = list(pool.map(ask, choices))
    for choice, out in zip(choices, outs):
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0].function
        if isinstance(choice, dict):
            assert call.name == choice["function"]["name"]
        args = json.loads(call.arguments)
        if call.name == "get_weather":
            assert set(args) == {"city", "days"} and 1 <= args["days"] <= 3 and len(args["city"]) <= 10
        else:
            assert args == {}
    bad = httpx.post(f"{client.base_url}chat/completions", json={
        "model": MODEL, "messages": msgs, "tools": tools, "tool_choice": {"type": "function",
                                                                          "function": {"name": "nope"}}})
    assert bad.status_code == 400 and "not in tools" in bad.text


def test_stop_strings_are_not_emitted(client):
    base = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop
    out = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == base[:base.find(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=12, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == out.choices[0].text


BAD = [
    ("/v1/completions", b"{not json", "malformed JSON"),
    ("/v1/completions", {"prompt": "x"}, "model"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, "context length"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 1100, "max_tokens": 5}, "context length"),
    ("/v1/completions", {"model": "gpt-nope", "prompt": "x"}, "does not exist"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 7}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 0}, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 999999], "max_tokens": 2}, "vocabulary"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, "no tools"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 1000}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, "text"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "bogus": 1}}, "unknown sampling"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/detokenize", {"tokens": [-1]}, "vocabulary"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs requires logprobs"),  # as OpenAI
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "regex": "[^\\s\\S]"}}, "matches no text"),
]


def test_bad_inputs_get_4xx_and_server_survives(server, client):
    for path, body, needle in BAD:
        if isinstance(body, bytes):
            r = httpx.post(server.base_url + path, content=body, headers={"content-type": "application/json"})
        else:
            r = httpx.post(server.base_url + path, json=body)
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
        err = r.json()
        assert err["object"] == "error" and needle in err["message"], (path, body, err)
    for stream in (True, False):  # a refused streaming request is refused before any byte is streamed
        r = httpx.post(server.base_url + "/v1/completions",
                       json={"model": MODEL, "prompt": "x " * 1100, "max_tokens": 5, "stream": stream})
        assert r.status_code == 400
    ok = client.completions.create(model=MODEL, prompt="still alive", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None
    null = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": None,
                                                                  "ignore_eos": True})
    assert null.status_code == 200 and null.json()["usage"]["completion_tokens"] == 16  # null: OpenAI's default
    server.wait_pools_free()


def test_64_concurrent_streams(server):
    async def one(client, i):
        n = 4 + i % 9
        body = {"model": MODEL, "prompt": f"client {i} says", "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        usage, text = None, ""
        async with client.stream("POST", "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    text += "".join(c["text"] for c in chunk["choices"])
        return n, usage, text

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    for n, usage, text in asyncio.run(main()):
        assert usage["completion_tokens"] == n and text
    server.wait_pools_free()


def test_disconnect_mid_stream_frees_slots(server):
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
    stats = server.wait_pools_free(timeout=15)  # far sooner than 900 tokens would take
    assert stats["num_running_reqs"] == 0


def test_non_streaming_disconnect_and_refused_batch_free_slots(server):
    """A non-streaming client that stops waiting, and a batch with one refused prompt: the other requests are
    aborted, their slots freed long before their 900 tokens."""
    base, long = server.base_url, {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0}
    cases = [("/generate", {"text": "hello", "sampling_params": long}),
             ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 900, "ignore_eos": True, "n": 3}),
             ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 900, "ignore_eos": True})]
    for path, body in cases:
        def leave():  # waits 3 s for a reply that needs ~30 s, then closes the connection
            try:
                httpx.post(f"{base}{path}", json=body, timeout=3.0)
            except httpx.TimeoutException:
                pass
        client = threading.Thread(target=leave)
        client.start()
        running = 0
        for _ in range(100):  # the request is seen running first: a free pool below is not a stale report
            running = (server.server_info().get("scheduler_stats") or {}).get("num_running_reqs", 0)
            if running:
                break
            time.sleep(0.05)
        client.join()
        assert running, path
        assert server.wait_pools_free(timeout=15)["num_running_reqs"] == 0, path
    refused = httpx.post(f"{base}/generate", json={"input_ids": [[1, 2], [-1]], "sampling_params": long}, timeout=60)
    assert refused.status_code == 400, refused.text
    time.sleep(1.0)  # then one short request, so the stats read below are newer than both
    httpx.post(f"{base}/generate", json={"input_ids": [3], "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    assert server.wait_pools_free(timeout=15)["num_running_reqs"] == 0


def test_server_output_equals_engine(server):
    import sglang

    ids = [5, 17, 300, 4000, 12, 99, 128803, 7]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    served = httpx.post(f"{server.base_url}/generate", json={"input_ids": ids, "sampling_params": params},
                        timeout=60).json()
    engine = sglang.Engine(model_path=MODEL, device="cpu", log_level="warning", max_running_requests=4,
                           context_length=1024)
    try:
        local = engine.generate(input_ids=ids, sampling_params=params)
    finally:
        engine.shutdown()
    assert served["output_ids"] == local["output_ids"] and served["text"] == local["text"]


def test_generate_parallel_samples(server):
    """`n` in /generate's sampling_params (upstream's parallel sampling): each prompt n times, prompt by prompt."""
    base = server.base_url
    greedy = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    one = httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": greedy}, timeout=60).json()
    two = httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**greedy, "n": 2}},
                     timeout=60).json()
    assert isinstance(two, list) and [o["output_ids"] for o in two] == [one["output_ids"]] * 2
    assert [o["index"] for o in two] == [0, 1]
    batch = httpx.post(f"{base}/generate", json={"input_ids": [[5, 6, 7], [8, 9]],
                                                 "sampling_params": {**greedy, "n": 3}}, timeout=60).json()
    other = httpx.post(f"{base}/generate", json={"input_ids": [8, 9], "sampling_params": greedy}, timeout=60).json()
    assert [o["output_ids"] for o in batch] == [one["output_ids"]] * 3 + [other["output_ids"]] * 3
    sampled = httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "n": 4}}, timeout=60).json()
    assert len(sampled) == 4 and len({tuple(o["output_ids"]) for o in sampled}) > 1  # independent draws
    seeded = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 5}
    pair = httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**seeded, "n": 2}},
                      timeout=60).json()
    from sglang.srt.entrypoints.openai.serving_base import choice_seed

    seeds = [choice_seed(5, c) for c in (0, 1)]
    solo = [httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**seeded, "seed": s}},
                       timeout=60).json()["output_ids"] for s in seeds]
    assert [o["output_ids"] for o in pair] == solo and solo[0] != solo[1]  # sample c: choice_seed, as OpenAI's n
    neighbour = httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        **seeded, "seed": 6, "n": 2}}, timeout=60).json()
    assert not {tuple(o["output_ids"]) for o in neighbour} & set(map(tuple, solo))  # seeds 5 and 6 share no sample
    server.wait_pools_free()


def test_min_tokens_and_the_earliest_stop_string(client):
    """min_tokens (SGLang's OpenAI extension) holds back every stop condition; when one token completes two stop
    strings, the output is cut before the one that starts first, whatever their order in the list."""
    prompt, greedy = "Once upon a time, in a land far away,", dict(temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=1, **greedy).choices[0]
    text, tokens, offsets = free.text, free.logprobs.tokens, free.logprobs.text_offset
    # a token of 2+ characters after some text: "x|ab" completes both "xa" (starts first) and "ab"
    k = next(i for i in range(1, len(tokens)) if len(tokens[i]) >= 2 and offsets[i] == len("".join(tokens[:i]))
             and offsets[i] >= 1 and text[offsets[i] - 1:offsets[i] + 1] not in text[:offsets[i] - 1]
             and tokens[i][:2] not in text[:offsets[i]])
    early, late = text[offsets[k] - 1:offsets[k] + 1], tokens[k][:2]
    for stops in ([late, early], [early, late]):
        cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stop=stops, **greedy).choices[0]
        assert cut.text == text[:offsets[k] - 1] and cut.model_extra["matched_stop"] == early, (stops, cut.text)
    for stream in (False, True):  # token 0's text is no stop before 4 tokens: the cut is at a later occurrence
        held = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stop=[tokens[0]], temperature=0,
                                         stream=stream, extra_body={"min_tokens": 4, "ignore_eos": True})
        held_text = "".join(c.choices[0].text for c in held) if stream else held.choices[0].text
        later = text.find(tokens[0], offsets[3] - len(tokens[0]) + 1)  # ends past the first 3 tokens' text
        assert held_text == (text if later < 0 else text[:later]), (stream, held_text, text)
        if not stream:
            assert held.usage.completion_tokens >= 4


def test_generate_stop_regex(server):
    """A stop_regex ends the output at its first match, cut before it (kept with no_stop_trim), streamed or not."""
    import re

    base = server.base_url
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    full = httpx.post(f"{base}/generate", json={"text": "Once upon", "sampling_params": greedy}, timeout=60).json()
    text = full["text"]
    piece = text[len(text) // 2:len(text) // 2 + 3]
    pattern = re.escape(piece[0]) + "." + re.escape(piece[2])  # a pattern, not a literal: its first match may differ
    first = re.search(pattern, text)
    cut = httpx.post(f"{base}/generate", json={"text": "Once upon", "sampling_params": {
        **greedy, "stop_regex": pattern}}, timeout=60).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": first.group(0)}
    assert cut["text"] == text[:first.start()]
    assert cut["output_ids"] == full["output_ids"][:len(cut["output_ids"])]
    kept = httpx.post(f"{base}/generate", json={"text": "Once upon", "sampling_params": {
        **greedy, "stop_regex": [pattern], "no_stop_trim": True}}, timeout=60).json()
    assert kept["text"].startswith(text[:first.end()]) and first.group(0) in kept["text"]
    with httpx.stream("POST", f"{base}/generate", json={"text": "Once upon", "stream": True, "sampling_params": {
            **greedy, "stop_regex": pattern}}, timeout=60) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["text"] == cut["text"]
    server.wait_pools_free()


def test_api_key(tmp_path):
    handle = launch(["--model-path", MODEL, "--api-key", "sekret", "--max-running-requests", "4",
                     "--context-length", "512"], str(tmp_path))
    try:
        base = handle.base_url
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/v1/models").status_code == 401
        bad = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and bad.json()["object"] == "error"
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret")
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="nope").models.list()
    finally:
        handle.stop()


def test_eval_scripts_and_bench_serving_against_the_server(server, tmp_path):
    """The accuracy scripts and bench_serving run end to end against our server (the tiny model's answers are
    random, so only the plumbing is checked here; scoring is proven against a stub in test_bench_clients)."""
    from sglang import bench_serving
    from test_bench_clients import _write_gsm8k, _write_mmlu, gsm8k, mmlu

    port = ["--port", server.base_url.rsplit(":", 1)[1], "--disable-tqdm"]
    _write_gsm8k(tmp_path / "test.jsonl")
    g = gsm8k.main(["--data-path", str(tmp_path / "test.jsonl"), "--num-questions", "4", "--max-tokens", "8",
                    "--result-file", str(tmp_path / "g.json"), *port])
    assert g.num_questions == 4 and 0 <= g.accuracy <= 1 and (tmp_path / "g.json").exists()
    _write_mmlu(tmp_path / "mmlu")
    m = mmlu.main(["--data-dir", str(tmp_path / "mmlu"), "--ntrain", "2", "--result-file", str(tmp_path / "m.json"),
                   *port])
    assert m.num_questions > 0 and 0 <= m.accuracy <= 1
    args = bench_serving.parse_args(["--backend", "sglang", "--dataset-name", "random", "--num-prompts", "16",
                                     "--random-input-len", "64", "--random-output-len", "16",
                                     "--random-range-ratio", "1.0", "--output-file", str(tmp_path / "b.jsonl"),
                                     *port])
    result = bench_serving.run_benchmark(args)
    assert result.completed == 16 and result.total_output_tokens == 16 * 16
    print(f"bench_serving (tiny model, CPU, 16 x 64->16): {result.output_throughput:.1f} output tok/s")
    server.wait_pools_free()


def test_update_weights_from_disk(server):
    """/update_weights_from_disk and /get_weights_by_name as upstream: running requests finish first (or are aborted
    with abort_all_requests), the checkpoint loads in place and the prefix cache empties; refusals are 400s with
    success false and nothing changed (the weights' exactness: test/srt/test_update_weights.py)."""
    from concurrent.futures import ThreadPoolExecutor

    base = server.base_url

    def post(path, body):
        return httpx.post(f"{base}{path}", json=body, timeout=300)

    def greedy():
        return post("/generate", {"input_ids": [7, 8, 9, 10], "sampling_params": {
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]

    before = greedy()
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, "/generate", {"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 60, "ignore_eos": True}})
        time.sleep(0.3)
        r = post("/update_weights_from_disk", {"model_path": MODEL})  # waits for the running request
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert running.result().json()["meta_info"]["finish_reason"]["type"] == "length"
        long = pool.submit(post, "/generate", {"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 900, "ignore_eos": True}})
        time.sleep(0.3)
        r = post("/update_weights_from_disk", {"model_path": MODEL, "abort_all_requests": True})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert long.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert greedy() == before  # the same checkpoint again: the same answers
    assert httpx.get(f"{base}/model_info").json()["model_path"] == MODEL
    missing = post("/update_weights_from_disk", {"model_path": "/nonexistent/checkpoint"})
    assert missing.status_code == 400 and missing.json()["success"] is False
    assert "/nonexistent/checkpoint" in missing.json()["message"]
    assert post("/update_weights_from_disk", {"model_path": MODEL, "load_format": "gguf"}).status_code == 400
    assert post("/update_weights_from_disk", {}).status_code == 400
    assert greedy() == before
    rows = post("/get_weights_by_name", {"name": "layers.0.attn.wq_a.weight", "truncate_size": 2}).json()
    assert len(rows) == 2 and len(rows[0]) == 256 and all(isinstance(v, float) for v in rows[0])  # hidden 256
    unknown = post("/get_weights_by_name", {"name": "no.such.weight"})
    assert unknown.status_code == 400 and "no.such.weight" in unknown.json()["message"]
    server.wait_pools_free()


def test_expert_distribution_record_endpoints(server):
    """Upstream's /start_expert_distribution_record, /stop_..., /dump_...: the dump is a torch file of counts per
    MoE layer and expert (their exactness: test/srt/test_expert_distribution.py)."""
    import torch

    base = server.base_url
    assert httpx.post(f"{base}/stop_expert_distribution_record").status_code in (200, 400)  # from any state
    assert httpx.post(f"{base}/start_expert_distribution_record").status_code == 200
    httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "ignore_eos": True}}, timeout=120).raise_for_status()
    assert httpx.post(f"{base}/stop_expert_distribution_record").status_code == 200
    again = httpx.post(f"{base}/stop_expert_distribution_record")
    assert again.status_code == 400 and "no expert distribution record is running" in again.json()["message"]
    dumped = httpx.post(f"{base}/dump_expert_distribution_record")
    assert dumped.status_code == 200, dumped.text
    path = dumped.text.strip().rsplit(" ", 1)[1]
    counts = torch.load(path)["logical_count"]
    os.remove(path)  # SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR: /tmp by default
    assert int(counts[0].sum()) > 0


def test_responses_api_with_the_openai_client(client):
    """/v1/responses through the openai SDK, non-streamed and streamed, continued by previous_response_id; a length
    limit gives status incomplete (the parsing: test_responses_api.py)."""
    first = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == 6 and first.output[0].type == "message"
    streamed = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert streamed[0].type == "response.created" and streamed[-1].type == "response.incomplete"  # as OpenAI's
    deltas = [e.delta for e in streamed if e.type == "response.output_text.delta"]
    assert "".join(deltas) == streamed[-1].response.output_text == first.output_text
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=3, extra_body={"ignore_eos": True})
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(second.id).id == second.id


def test_background_responses_with_the_openai_client(server, client):
    """A background response polled with retrieve ends as the same request run in the foreground, streamed too (and
    streamed again from its third event); one cancelled while generating stops, its slots freed long before its 900
    tokens."""
    params = dict(model=MODEL, input="Hello", max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.responses.create(**params)
    queued = client.responses.create(background=True, **params)
    assert queued.status == "queued" and queued.background
    for _ in range(600):
        done = client.responses.retrieve(queued.id)
        if done.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert done.status == "incomplete" and done.output_text == plain.output_text
    streamed = list(client.responses.create(background=True, stream=True, **params))
    assert [e.type for e in streamed[:2]] == ["response.created", "response.queued"]
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.output_text == plain.output_text
    resumed = list(client.responses.retrieve(streamed[0].response.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in resumed] == [e.sequence_number for e in streamed[3:]]
    long = client.responses.create(background=True, model=MODEL, input="a long story", max_output_tokens=900,
                                   temperature=0, extra_body={"ignore_eos": True})
    running = 0
    for _ in range(200):  # seen running first: a free pool below is not a stale report
        running = (server.server_info().get("scheduler_stats") or {}).get("num_running_reqs", 0)
        if running and client.responses.retrieve(long.id).status == "in_progress":
            break
        time.sleep(0.05)
    assert running
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.usage is None
    assert server.wait_pools_free(timeout=15)["num_running_reqs"] == 0
