"""Streamed logprobs against a real server (the built-in tiny model): every generated token carries exactly one
logprob entry in the stream, also tokens that show no text of their own (a partial UTF-8 character, text held
back because it could begin a stop string), and the streamed entries equal the non-streaming response's."""

from __future__ import annotations

import json

import httpx
import pytest

from server_process import launch

MODEL = "tiny-deepseek-v4"
PROMPTS = ["The capital of France is", "1, 2, 3,", "def f(x):", "Hello"]
LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = launch(["--model-path", MODEL, "--context-length", "512"], str(tmp_path_factory.mktemp("server")))
    yield handle
    handle.stop()


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_frames(server, path: str, body: dict) -> list:
    body = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
    frames = []
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[6:]))
    assert "usage" in frames[-1] and not any("error" in f for f in frames)
    return frames


def streamed_completion(server, body: dict) -> tuple:
    """-> (text, logprobs merged over the frames, per-frame token counts, usage.completion_tokens)."""
    frames = stream_frames(server, "/v1/completions", body)
    text, merged, per_frame = "", {k: [] for k in LOGPROB_KEYS}, []
    for frame in frames[:-1]:
        (choice,) = frame["choices"]
        text += choice["text"]
        lp = choice["logprobs"]
        if lp is None:
            per_frame.append(0)
            continue
        assert len({len(lp[k]) for k in LOGPROB_KEYS}) == 1, lp  # the four lists stay aligned in every frame
        per_frame.append(len(lp["tokens"]))
        for k in LOGPROB_KEYS:
            merged[k] += lp[k]
    return text, merged, per_frame, frames[-1]["usage"]["completion_tokens"]


def assert_same_logprobs(streamed: dict, whole: dict) -> None:
    assert streamed["tokens"] == whole["tokens"] and streamed["text_offset"] == whole["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-5)
    assert [sorted(t) for t in streamed["top_logprobs"]] == [sorted(t) for t in whole["top_logprobs"]]
    for s, w in zip(streamed["top_logprobs"], whole["top_logprobs"]):
        assert s == pytest.approx(w, abs=1e-5)


def check_completion(server, body: dict) -> list:
    """Stream and non-stream the same request; returns the streamed per-frame token counts."""
    whole = post(server, "/v1/completions", body)
    text, lp, per_frame, usage_tokens = streamed_completion(server, body)
    (choice,) = whole["choices"]
    assert text == choice["text"]
    assert len(lp["tokens"]) == usage_tokens == whole["usage"]["completion_tokens"] == len(choice["logprobs"]["tokens"])
    assert_same_logprobs(lp, choice["logprobs"])
    return per_frame


def held_back_stop(tokens: list, text: str) -> tuple:
    """A stop string that a whole token begins: (stop, k) with stop = tokens[k - 1] + the first character of
    tokens[k], first found in `text` right after tokens[:k - 1]. Token k - 1 then shows no text of its own (it
    could begin the stop string) and token k completes the match."""
    def shown(t: str) -> str:  # a special token's text is not shown (skip_special_tokens)
        return "" if t.startswith("<|") and t.endswith("|>") else t

    for k in range(3, len(tokens)):
        before, held, nxt = "".join(shown(t) for t in tokens[:k - 1]), shown(tokens[k - 1]), shown(tokens[k])
        clean = all(t and "\ufffd" not in t for t in (held, nxt))
        if clean and text.startswith(before + held + nxt) and text.find(held + nxt[0]) == len(before):
            return held + nxt[0], k
    raise AssertionError(f"no usable stop string in {tokens}")


def test_every_token_has_one_streamed_logprob(server):
    silent = 0  # tokens that showed no text of their own (they ride in a later frame)
    for sampling, prompts in (({"temperature": 0}, PROMPTS), ({"temperature": 1.0, "seed": 1234}, PROMPTS[:2])):
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 24, "logprobs": 2, "ignore_eos": True, **sampling}
            per_frame = check_completion(server, body)
            assert sum(per_frame) == 24
            silent += sum(n - 1 for n in per_frame if n > 1)
    # The case that used to lose entries must have happened, or this test proves nothing: one token per decode
    # step, so a frame with k > 1 entries carries k - 1 tokens that completed no visible text (here a partial
    # UTF-8 character and a special token that skip_special_tokens hides).
    assert silent > 0


def test_stop_string_held_back_and_matched_tokens_keep_logprobs(server):
    base = {"prompt": "Once upon a time", "max_tokens": 24, "logprobs": 1, "temperature": 0, "ignore_eos": True}
    full = post(server, "/v1/completions", base)["choices"][0]
    stop, k = held_back_stop(full["logprobs"]["tokens"], full["text"])
    per_frame = check_completion(server, {**base, "stop": [stop]})
    whole = post(server, "/v1/completions", {**base, "stop": [stop]})["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["text"] == full["text"][:full["text"].index(stop)]
    # the matched stop string's tokens keep their entries (they count in usage), streamed or not
    assert whole["logprobs"]["tokens"] == full["logprobs"]["tokens"][:k + 1]
    assert per_frame[-1] == 2  # the held-back token arrives with the final frame, next to the one that matched


def test_echo_offsets_and_n_choices(server):
    body = {"prompt": "Hello", "max_tokens": 8, "logprobs": 0, "temperature": 0, "ignore_eos": True, "echo": True}
    whole = post(server, "/v1/completions", body)["choices"][0]
    assert whole["logprobs"]["text_offset"][0] == len("Hello")
    frames = stream_frames(server, "/v1/completions", body)
    offsets = [o for f in frames[:-1] for o in (f["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert offsets == whole["logprobs"]["text_offset"]
    sampled = {"prompt": ["a b", "c d"], "max_tokens": 8, "logprobs": 1, "n": 2, "temperature": 1.0, "seed": 7,
               "ignore_eos": True}
    frames = stream_frames(server, "/v1/completions", sampled)
    counts = {}
    for f in frames[:-1]:
        for c in f["choices"]:
            counts[c["index"]] = counts.get(c["index"], 0) + len((c["logprobs"] or {}).get("tokens", []))
    assert counts == {0: 8, 1: 8, 2: 8, 3: 8} and frames[-1]["usage"]["completion_tokens"] == 32


def streamed_chat(server, body: dict) -> tuple:
    """-> (content, logprob entries, number of frames carrying entries but no content)."""
    frames = stream_frames(server, "/v1/chat/completions", body)
    content, entries, logprob_only = "", [], 0
    for f in frames[:-1]:
        (choice,) = f["choices"]
        content += choice["delta"].get("content") or ""
        new = (choice["logprobs"] or {"content": []})["content"]
        entries += new
        logprob_only += bool(new) and not choice["delta"].get("content")
    assert len(entries) == frames[-1]["usage"]["completion_tokens"]
    return content, entries, logprob_only


def test_chat_stream_logprobs_match_non_stream(server):
    msgs = [{"role": "user", "content": "Hello"}]
    base = {"messages": msgs, "max_tokens": 24, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    full = post(server, "/v1/chat/completions", {**base, "temperature": 0})["choices"][0]
    tokens = [e["token"] for e in full["logprobs"]["content"]]
    stop, k = held_back_stop(tokens, full["message"]["content"])
    logprob_only = 0
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 99}, {"temperature": 0, "stop": [stop]}):
        whole = post(server, "/v1/chat/completions", {**base, **extra})
        content, entries, n = streamed_chat(server, {**base, **extra})
        expected = whole["choices"][0]["logprobs"]["content"]
        assert len(entries) == len(expected) == whole["usage"]["completion_tokens"]
        assert content == whole["choices"][0]["message"]["content"]
        assert [e["token"] for e in entries] == [e["token"] for e in expected]
        assert [e["logprob"] for e in entries] == pytest.approx([e["logprob"] for e in expected], abs=1e-5)
        assert [[t["token"] for t in e["top_logprobs"]] for e in entries] == \
            [[t["token"] for t in e["top_logprobs"]] for e in expected]
        logprob_only += n
    assert len(expected) == k + 1  # the stop run: up to and including the token that completed the stop string
    assert logprob_only > 0  # tokens without visible text did occur (the held-back one at least)
