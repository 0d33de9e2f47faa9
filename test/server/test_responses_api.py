"""POST /v1/responses (OpenAI's Responses API) on scripted model output in the real FastAPI app: reasoning, text and
function_call output items, streamed events that add up to the same response, stored responses continued by
previous_response_id (with function_call_output items), GET / DELETE, background responses (polled, cancelled,
failed), and 4xx for what is not supported."""

from __future__ import annotations

import json
import time

from sglang.srt.managers.tokenizer_manager import RequestError
from test_chat_glue import CALL, TWO_CALLS

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}]


def respond(client, stream=False, **body):
    return client.post("/v1/responses", json={"model": "scripted", "input": "weather?", "stream": stream, **body})


def events(resp) -> list:
    out = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_reasoning_text_and_function_call_items(app):
    tm, client = app
    tm.script = "I should call the tool.</think>Let me check." + CALL
    body = dict(tools=TOOLS, reasoning={"effort": "high"}, instructions="Be brief.")
    r = respond(client, **body)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert tm.prompts[-1].startswith("<｜begin▁of▁sentence｜>Be brief.") and "## Tools" in tm.prompts[-1]
    assert tm.prompts[-1].endswith("<｜Assistant｜><think>")  # reasoning.effort: thinking mode
    assert resp["object"] == "response" and resp["status"] == "completed" and resp["id"].startswith("resp")
    kinds = [item["type"] for item in resp["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    reasoning, message, call = resp["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "I should call the tool."}]
    assert message["content"][0] == {"type": "output_text", "text": "Let me check.", "annotations": []}
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "days": 3}
    usage = resp["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]

    streamed = events(respond(client, stream=True, **body))
    assert streamed[0]["type"] == "response.created" and streamed[-1]["type"] == "response.completed"
    final = streamed[-1]["response"]
    assert [i["type"] for i in final["output"]] == kinds
    text = "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta")
    thought = "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta")
    args = "".join(e["delta"] for e in streamed if e["type"] == "response.function_call_arguments.delta")
    assert (thought, text) == ("I should call the tool.", "Let me check.")
    assert json.loads(args) == {"city": "Paris", "days": 3}
    added = [e["item"]["type"] for e in streamed if e["type"] == "response.output_item.added"]
    done = [e["item"]["type"] for e in streamed if e["type"] == "response.output_item.done"]
    assert added == done == kinds
    for a, b in zip(final["output"], resp["output"]):
        assert {k: v for k, v in a.items() if k not in ("id", "call_id")} == \
            {k: v for k, v in b.items() if k not in ("id", "call_id")}


def test_parallel_tool_calls_false_keeps_the_first_call(app):
    tm, client = app
    tm.script = "Checking." + TWO_CALLS
    for parallel, cities in ((True, ["Paris", "Rome"]), (False, ["Paris"])):
        resp = respond(client, tools=TOOLS, parallel_tool_calls=parallel).json()
        assert resp["parallel_tool_calls"] is parallel
        calls = [item for item in resp["output"] if item["type"] == "function_call"]
        assert [json.loads(c["arguments"])["city"] for c in calls] == cities
        final = events(respond(client, stream=True, tools=TOOLS, parallel_tool_calls=parallel))[-1]["response"]
        assert [json.loads(i["arguments"])["city"] for i in final["output"] if i["type"] == "function_call"] == cities


def test_continuation_by_previous_response_id(app):
    tm, client = app
    tm.script = "Checking." + CALL
    first = respond(client, tools=TOOLS).json()
    call = first["output"][-1]
    assert call["type"] == "function_call"
    tm.script = "It is sunny in Paris."
    r = respond(client, tools=TOOLS, previous_response_id=first["id"], input=[
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}])
    assert r.status_code == 200, r.text
    second = r.json()
    assert second["previous_response_id"] == first["id"] and second["output"][0]["type"] == "message"
    prompt = tm.prompts[-1]  # the whole conversation: question, the call, its result
    assert "weather?" in prompt and 'invoke name="get_weather"' in prompt and "sunny" in prompt
    assert client.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
    assert client.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
    gone = client.get(f"/v1/responses/{first['id']}")
    assert gone.status_code == 404
    assert respond(client, previous_response_id=first["id"]).status_code == 404
    unstored = respond(client, store=False).json()
    assert client.get(f"/v1/responses/{unstored['id']}").status_code == 404


def test_refusals(app):
    """(max_output_tokens and status incomplete: test_server_api.py, on the real engine)"""
    tm, client = app
    tm.script = "An answer."
    for body, param in ((dict(background=True, store=False), "store"),
                        (dict(tools=[{"type": "web_search"}]), "tools"),
                        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                         "input"), (dict(input=[{"type": "item_reference", "id": "x"}]), "input")):
        r = respond(client, **body)
        assert r.status_code == 400 and r.json()["param"] == param, (body, r.text)
    for body, param, words in (  # from a fuzz pass: each a 400 naming what is wrong (one was a 500)
            (dict(input=[{"type": "reasoning", "summary": "x", "content": 5}]), "input", "reasoning item"),
            (dict(input=[{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]), "input",
             "reasoning item"),
            (dict(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "input", "string text"),
            (dict(input=[]), "input", "at least one item"),
            (dict(tools=[{"type": "function", "name": "", "parameters": {}}]), "tools", "non-empty string name"),
            (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice", '"name"'),
            (dict(tools=TOOLS, tool_choice="garbage"), "tool_choice", '"name"'),
            (dict(top_logprobs=3), "top_logprobs", "not supported"), (dict(n=3), "n", "not supported"),
            (dict(reasoning={"effort": "high"}, chat_template_kwargs="x"), "chat_template_kwargs", "an object")):
        r = respond(client, **body)
        assert r.status_code == 400 and r.json()["param"] == param and words in r.json()["message"], (body, r.text)
    chat_form = [{"type": "function", "function": TOOLS[0]}]  # the chat endpoint's tool form is taken too
    assert respond(client, tools=chat_form, tool_choice=None, n=1).status_code == 200
    missing = client.get("/v1/responses/resp-unknown")
    assert missing.status_code == 404 and missing.json()["param"] is None
    assert respond(client, model="other").status_code == 404
    forced = respond(client, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    assert forced.status_code == 200, forced.text  # OpenAI's flat form, as the chat endpoint's nested one
    unknown = respond(client, tools=TOOLS, tool_choice={"type": "function", "name": "nope"})
    assert unknown.status_code == 400 and "nope" in unknown.json()["message"]
    structured = respond(client, text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}})
    assert structured.status_code == 200, structured.text


def poll(client, response_id: str, until=("completed", "incomplete", "failed", "cancelled")) -> dict:
    for _ in range(500):
        resp = client.get(f"/v1/responses/{response_id}").json()
        if resp["status"] in until:
            return resp
        time.sleep(0.01)
    raise AssertionError(f"response {response_id} stayed {resp['status']}")


def test_background_response_is_polled_to_the_same_output(app):
    tm, client = app
    tm.script = "I should call the tool.</think>Let me check." + CALL
    body = dict(tools=TOOLS, reasoning={"effort": "high"})
    plain = respond(client, **body).json()
    tm.token_delay = 0.002
    r = respond(client, background=True, **body)
    assert r.status_code == 200, r.text
    queued = r.json()
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
    midway = poll(client, queued["id"], until=("in_progress",))
    assert midway["usage"] is None
    done = poll(client, queued["id"])
    assert done["status"] == "completed" and done["usage"] == plain["usage"] and plain["background"] is False
    assert [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in done["output"]] == \
        [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in plain["output"]]
    tm.script, tm.token_delay = "It is sunny.", 0.0  # a background response continues a conversation as any other
    follow = respond(client, previous_response_id=done["id"], input=[
        {"type": "function_call_output", "call_id": done["output"][-1]["call_id"], "output": "sunny"}])
    assert follow.status_code == 200 and "get_weather" in tm.prompts[-1]


def test_background_response_cancelled_and_deleted(app):
    tm, client = app
    tm.script, tm.token_delay = "word " * 150, 0.02  # ~3 s of generation
    queued = respond(client, background=True).json()
    poll(client, queued["id"], until=("in_progress",))
    early = respond(client, previous_response_id=queued["id"])  # nothing to continue yet
    assert early.status_code == 400 and early.json()["param"] == "previous_response_id", early.text
    assert "still in_progress" in early.json()["message"]
    closed = tm.closed
    cancelled = client.post(f"/v1/responses/{queued['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled" and tm.closed == closed + 1  # the generation was stopped
    assert client.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
    again = client.post(f"/v1/responses/{queued['id']}/cancel").json()  # cancelling again changes nothing
    assert again["status"] == "cancelled"
    running = respond(client, background=True).json()  # DELETE stops one still generating
    poll(client, running["id"], until=("in_progress",))
    closed = tm.closed
    assert client.delete(f"/v1/responses/{running['id']}").json()["deleted"] is True
    assert tm.closed == closed + 1 and client.get(f"/v1/responses/{running['id']}").status_code == 404
    tm.token_delay = 0.0
    finished = respond(client).json()
    refused = client.post(f"/v1/responses/{finished['id']}/cancel")
    assert refused.status_code == 400 and "background" in refused.json()["message"]
    assert client.post("/v1/responses/resp-unknown/cancel").status_code == 404


def test_background_response_that_fails(app, monkeypatch):
    tm, client = app
    real = tm.generate

    async def refused(ids, params, *args, **kwargs):
        if params.max_new_tokens == 7:
            raise RequestError("the scheduler refused it", 400)
        async for chunk in real(ids, params, *args, **kwargs):
            yield chunk

    monkeypatch.setattr(tm, "generate", refused)
    failed = poll(client, respond(client, background=True, max_output_tokens=7).json()["id"])
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "invalid_prompt", "message": "the scheduler refused it"}


def test_shutdown_stops_background_responses():
    """The app's shutdown cancels the background responses still generating (their requests aborted)."""
    from fastapi.testclient import TestClient
    from sglang.srt.entrypoints.http_server import create_app
    from sglang.srt.server_args import ServerArgs
    from test_chat_glue import ScriptedTokenizerManager

    tm = ScriptedTokenizerManager()
    app = create_app(tm, ServerArgs(model_path="scripted"))
    with TestClient(app) as client:
        tm.script, tm.token_delay = "word " * 200, 0.02
        response_id = respond(client, background=True).json()["id"]
        poll(client, response_id, until=("in_progress",))
        closed = tm.closed
    assert tm.closed == closed + 1 and app.state.responses.get(response_id).response["status"] == "cancelled"


def test_background_stream_is_resumed_from_any_event(app):
    """background + stream: the same events as a foreground stream (plus response.queued), numbered from 0; GET
    ?stream=true&starting_after=N streams them again from N + 1, also while the generation goes on after the first
    client left; a response created without stream has no events to stream."""
    tm, client = app
    tm.script = "I should call the tool.</think>Let me check." + CALL
    body = dict(tools=TOOLS, reasoning={"effort": "high"})
    plain = events(respond(client, stream=True, **body))
    tm.token_delay = 0.002
    streamed = events(respond(client, stream=True, background=True, **body))
    kinds = [e["type"] for e in streamed]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert streamed[0]["response"]["status"] == "queued" and streamed[-1]["type"] == "response.completed"
    assert [k for k in kinds if k != "response.queued"] == [e["type"] for e in plain]
    response_id = streamed[0]["response"]["id"]
    again = client.get(f"/v1/responses/{response_id}?stream=true&starting_after=5")
    assert again.status_code == 200
    assert events_after(again, 5) == streamed[6:]
    assert events_after(client.get(f"/v1/responses/{response_id}?stream=true"), -1) == streamed

    tm.script, tm.token_delay = "word " * 60, 0.01  # the first client leaves after a few events; it goes on
    with client.stream("POST", "/v1/responses", json={"model": "scripted", "input": "go", "stream": True,
                                                      "background": True}) as first:
        lines = first.iter_lines()
        head = [json.loads(line[6:]) for line in (next(lines) for _ in range(8)) if line.startswith("data: ")]
    response_id = head[0]["response"]["id"]
    seen = head[-1]["sequence_number"]
    rest = events_after(client.get(f"/v1/responses/{response_id}?stream=true&starting_after={seen}"), seen)
    assert rest[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in head + rest if e["type"] == "response.output_text.delta")
    assert text == rest[-1]["response"]["output"][0]["content"][0]["text"] == "word " * 60

    polled = respond(client, background=True).json()
    refused = client.get(f"/v1/responses/{polled['id']}?stream=true")
    assert refused.status_code == 400 and refused.json()["param"] == "stream"
    bad = client.get(f"/v1/responses/{response_id}?stream=true&starting_after=-3")
    assert bad.status_code == 400 and bad.json()["param"] == "starting_after"


def events_after(resp, after: int) -> list:
    out = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert [e["sequence_number"] for e in out] == list(range(after + 1, after + 1 + len(out)))
    return out


def test_cancelled_background_stream_ends(app):
    """Cancelling a streamed background response ends its event stream (no final event; status cancelled), for a
    reader that joins after as for one that was waiting."""
    tm, client = app
    tm.script, tm.token_delay = "word " * 300, 0.01
    with client.stream("POST", "/v1/responses", json={"model": "scripted", "input": "go", "stream": True,
                                                      "background": True}) as first:
        lines = first.iter_lines()
        head = [json.loads(line[6:]) for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        response_id = head[0]["response"]["id"]
        assert client.post(f"/v1/responses/{response_id}/cancel").json()["status"] == "cancelled"
        rest = [line for line in lines if line.startswith("data: ")]  # the waiting reader: the stream ends
    assert rest[-1] == "data: [DONE]" and len(rest) < 290
    replay = events_after(client.get(f"/v1/responses/{response_id}?stream=true"), -1)
    assert replay[-1]["type"] == "response.output_text.delta" and len(replay) < 300
