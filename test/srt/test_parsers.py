"""Reasoning parser and DSML tool-call detector: spec section 3/4 parsing vectors, streaming == non-streaming for
every split point, invalid-call handling, and the encode -> parse round trip."""

from __future__ import annotations

import json
import random

import pytest

from sglang.srt.entrypoints.openai.encoding_dsv4 import encode_messages, render_tool_calls
from sglang.srt.function_call import (DeepSeekV4Detector, ToolCallError, ToolCallItem, get_tool_call_parser,
                                      validate_tools)
from sglang.srt.parser import ReasoningParser, get_reasoning_parser

EOS = "<｜end▁of▁sentence｜>"
WX = {"type": "function", "function": {
    "name": "get_weather", "description": "Get weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}}
TOOLS = [WX, SEARCH]

P1 = "Simple arithmetic.</think>2 + 2 = 4.<｜end▁of▁sentence｜>"
P2 = ("User wants Paris weather.</think>Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
      "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
      "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
      "<｜DSML｜parameter name=\"metric\" string=\"false\">false</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
      "</｜DSML｜tool_calls><｜end▁of▁sentence｜>")
P3 = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
      "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
      "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" string=\"true\">Rome \"old town\"\nmap"
      "</｜DSML｜parameter>\n<｜DSML｜parameter name=\"filters\" string=\"false\">{\"lang\":[\"en\",\"it\"],\"safe\":null}"
      "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>")
P2_CALL = ToolCallItem(0, "get_weather", '{"city": "Paris", "days": 3, "metric": false}')
P3_CALLS = [ToolCallItem(0, "get_weather", '{"city": "Paris"}'),
            ToolCallItem(1, "search", '{"query": "Rome \\"old town\\"\\nmap", "filters": {"lang":["en","it"],"safe":null}}')]


def invoke(name: str, *params: tuple) -> str:
    body = "".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>\n' for k, s, v in params)
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'


def block(*invokes: str) -> str:
    return "\n\n<｜DSML｜tool_calls>\n" + "".join(invokes) + "</｜DSML｜tool_calls>"


def chunkings(text: str, seed: int = 0):
    """Every two-piece split, one-character pieces, and a few random multi-piece splits."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


# ---- reasoning parser ----------------------------------------------------------------------------------------

def stream_reasoning(text_pieces, thinking):
    parser = ReasoningParser("deepseek-v4", thinking=thinking)
    pieces = [parser.parse_stream_chunk(p) for p in text_pieces] + [parser.flush()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


def test_reasoning_parse_vectors():
    assert ReasoningParser("deepseek-v4", thinking=True).parse_non_stream(P1) == ("Simple arithmetic.", "2 + 2 = 4.")
    reasoning, content = ReasoningParser(thinking=True).parse_non_stream(P2)
    assert reasoning == "User wants Paris weather." and content.startswith("Let me check.\n\n<｜DSML｜tool_calls>")
    assert not content.endswith(EOS)
    assert ReasoningParser(thinking=False).parse_non_stream(P3) == (None, P3[:-len(EOS)])


@pytest.mark.parametrize("thinking,text,expected", [
    (True, "no end yet", ("no end yet", "")),  # truncated: all reasoning
    (True, "</think>", ("", "")),
    (True, "a</think>b</think>c", ("a", "b</think>c")),  # only the first marker splits
    (True, "plan" + block(invoke("f")), ("plan", block(invoke("f")))),  # tool block before </think> -> content
    (True, "x<｜DSML｜tool_calls>", ("x", "<｜DSML｜tool_calls>")),
    (True, "r</think>c" + EOS + "junk", ("r", "c")),
    (False, "Simple</think>answer", (None, "Simple</think>answer")),  # chat mode: all content
])
def test_reasoning_cases_and_streaming(thinking, text, expected):
    assert ReasoningParser(thinking=thinking).parse_non_stream(text) == expected
    for pieces in chunkings(text):
        assert stream_reasoning(pieces, thinking) == (expected[0] or "", expected[1])


@pytest.mark.parametrize("text", [P1, P2, P3, "Think <b>hard</b> </thin k></think>\n\nAnswer with < and </"])
def test_reasoning_stream_equals_non_stream_every_split(text):
    for thinking in (True, False):
        reasoning, content = ReasoningParser(thinking=thinking).parse_non_stream(text)
        for pieces in chunkings(text):
            assert stream_reasoning(pieces, thinking) == (reasoning or "", content), pieces


def test_reasoning_stream_never_emits_partial_marker():
    parser = ReasoningParser(thinking=True)
    emitted = [parser.parse_stream_chunk(ch) for ch in "abc</think>def"]
    assert all("<" not in r and "<" not in c for r, c in emitted)
    assert emitted[3] == ("", "") and parser.flush() == ("", "")


def test_reasoning_parser_registry():
    with pytest.raises(ValueError, match="deepseek-v4"):
        ReasoningParser("qwen3", thinking=True)
    with pytest.raises(ValueError, match="supported: deepseek-v4"):
        get_reasoning_parser("deepseek-r1")
    assert get_reasoning_parser("deepseek-v4")(thinking=True).parse_non_stream(P1)[0] == "Simple arithmetic."


# ---- tool-call detector -----------------------------------------------------------------------------------------

def stream_tools(pieces, tools, strict=False):
    det = DeepSeekV4Detector(strict=strict)
    results = [det.parse_streaming_increment(p, tools) for p in pieces] + [det.flush(tools)]
    calls = [ToolCallItem(c.index, c.name, c.arguments) for r in results for c in r.calls]
    return "".join(r.normal_text for r in results), calls, det.errors


def test_tool_parse_vectors():
    content = ReasoningParser(thinking=True).parse_non_stream(P2)[1]
    assert DeepSeekV4Detector().detect_and_parse(content, TOOLS) == ("Let me check.", [P2_CALL])
    assert DeepSeekV4Detector().detect_and_parse(P3, TOOLS) == ("", P3_CALLS)
    assert json.loads(P3_CALLS[1].arguments) == {"query": 'Rome "old town"\nmap',
                                                 "filters": {"lang": ["en", "it"], "safe": None}}
    assert DeepSeekV4Detector().detect_and_parse("plain answer" + EOS, TOOLS) == ("plain answer", [])
    assert DeepSeekV4Detector.has_tool_call(P3) and not DeepSeekV4Detector.has_tool_call("x")


MIXED = ("Checking both.\n" + block(
    invoke("get_weather", ("city", "true", " São Paulo \n"), ("days", "false", " 7 ")),
    invoke("search", ("query", "true", 'a "b" <c> \\ d'), ("filters", "false", '{"x": {"y": [1, {"z": null}]}}')),
    invoke("search")) + "\nDone.")


@pytest.mark.parametrize("text", [P3, MIXED, "no tools at all\n\n", "text then <｜DS partial at end",
                                  "a\n\n\n" + block(invoke("search", ("query", "true", "q"))) + EOS + "ignored"])
def test_tool_stream_equals_non_stream_every_split(text):
    expected = DeepSeekV4Detector().detect_and_parse(text, TOOLS)
    for pieces in chunkings(text):
        normal, calls, errors = stream_tools(pieces, TOOLS)
        assert (normal, calls) == expected, pieces
        assert not errors


def test_string_vs_non_string_and_nested_values():
    normal, calls = DeepSeekV4Detector().detect_and_parse(MIXED, TOOLS)
    assert normal == "Checking both.\n\nDone."
    assert [c.index for c in calls] == [0, 1, 2]
    assert calls[0].arguments == '{"city": " São Paulo \\n", "days": 7}'  # strings verbatim, JSON values trimmed
    assert json.loads(calls[1].arguments) == {"query": 'a "b" <c> \\ d', "filters": {"x": {"y": [1, {"z": None}]}}}
    assert calls[2] == ToolCallItem(2, "search", "{}")


def test_streamed_call_is_one_delta_and_no_partial_marker_leaks():
    det = DeepSeekV4Detector()
    text = "Hi" + block(invoke("search", ("query", "true", "q"))) + "!"
    out = [det.parse_streaming_increment(ch, TOOLS) for ch in text] + [det.flush(TOOLS)]
    assert all("｜" not in r.normal_text and "DSML" not in r.normal_text for r in out)
    deltas = [c for r in out for c in r.calls]
    assert len(deltas) == 1 and (deltas[0].index, deltas[0].name, deltas[0].arguments) == (0, "search", '{"query": "q"}')
    assert "".join(r.normal_text for r in out) == "Hi\n\n!"  # text after the block is not glued on


AFTER = invoke("search", ("query", "true", "q"))


def test_forward_unknown_tools(monkeypatch):
    """SGLANG_FORWARD_UNKNOWN_TOOLS (upstream's): a call to a tool the request did not offer is a call, its arguments
    unchecked, streamed or not; offered tools keep their schema checks."""
    from sglang.srt.environ import envs

    text = block(BAD_INVOKES["unknown tool"] + BAD_INVOKES["schema: wrong type"])
    assert DeepSeekV4Detector().detect_and_parse(text, TOOLS)[1] == []
    monkeypatch.setenv(envs.SGLANG_FORWARD_UNKNOWN_TOOLS.name, "1")
    det = DeepSeekV4Detector()
    normal, calls = det.detect_and_parse(text, TOOLS)
    assert calls == [ToolCallItem(0, "delete_everything", '{"path": "/"}')]
    assert len(det.errors) == 1 and "integer" in det.errors[0].reason  # the offered tool's schema still applies
    for pieces in list(chunkings(text))[::5]:
        assert stream_tools(pieces, TOOLS)[:2] == (normal, calls)


@pytest.mark.parametrize("text,normal", [
    ("Before." + block(AFTER) + "After.", "Before.\n\nAfter."),  # never "Before.After."
    ("Before." + block(AFTER) + "\n\n  After.\n" + EOS, "Before.\n\nAfter.\n"),  # leading whitespace dropped
    ("Before.\n" + block(AFTER) + "\nAfter.", "Before.\n\nAfter."),  # earlier newlines count toward the blank line
    ("Before.\n\n\n" + block(AFTER) + "After.", "Before.\n\n\nAfter."),  # already separated: nothing added
    (block(AFTER) + "\n\nAfter.", "After."),  # nothing before: no separator
    (block(AFTER) + "\n \n" + EOS, ""),  # whitespace after the block is not content
    ("A" + block(AFTER) + "B" + block(AFTER) + "C", "A\n\nB\n\nC"),
    ("A" + block(AFTER) + "\n" + block(AFTER) + "C", "A\n\nC"),
])
def test_text_after_block_is_a_separate_paragraph(text, normal):
    n_calls = text.count(AFTER)
    expected = (normal, [ToolCallItem(i, "search", '{"query": "q"}') for i in range(n_calls)])
    assert DeepSeekV4Detector().detect_and_parse(text, TOOLS) == expected
    for pieces in chunkings(text):  # tools=None: the same parse without the (slow) schema checks
        assert stream_tools(pieces, None) == expected + ([],), pieces


def test_raw_json_invoke_body():
    text = block('<｜DSML｜invoke name="get_weather">\n{"city": "Oslo", "days": 1}\n</｜DSML｜invoke>\n')
    assert DeepSeekV4Detector().detect_and_parse(text, TOOLS)[1] == [
        ToolCallItem(0, "get_weather", '{"city": "Oslo", "days": 1}')]


BAD_INVOKES = {
    "unknown tool": invoke("delete_everything", ("path", "true", "/")),
    "schema: wrong type": invoke("get_weather", ("city", "true", "Paris"), ("days", "true", "three")),
    "schema: missing required": invoke("get_weather", ("days", "false", "3")),
    "schema: extra property": invoke("get_weather", ("city", "true", "P"), ("mood", "true", "x")),
    "duplicate parameter": invoke("search", ("query", "true", "a"), ("query", "true", "b")),
    "bad string flag": invoke("search", ("query", "maybe", "a")),
    "non-JSON value": invoke("search", ("filters", "false", "{lang: en}")),
    "NaN": invoke("get_weather", ("city", "true", "P"), ("days", "false", "NaN")),
    "duplicate JSON key": invoke("search", ("filters", "false", '{"a": 1, "a": 2}')),
    "bad header": '<｜DSML｜invoke nam="search">\n</｜DSML｜invoke>\n',
    "unclosed parameter": '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="query" string="true">x\n</｜DSML｜invoke>\n',
    "stray text in invoke": '<｜DSML｜invoke name="search">\nhello\n</｜DSML｜invoke>\n',
}


@pytest.mark.parametrize("case", sorted(BAD_INVOKES))
def test_invalid_call_becomes_text_and_is_reported(case):
    bad = BAD_INVOKES[case]
    good = invoke("search", ("query", "true", "ok"))
    text = "Pre" + block(good, bad, good)
    det = DeepSeekV4Detector()
    normal, calls = det.detect_and_parse(text, TOOLS)
    assert normal == "Pre" + bad.rstrip("\n")  # the rejected call's raw text, nothing else
    assert calls == [ToolCallItem(0, "search", '{"query": "ok"}'), ToolCallItem(1, "search", '{"query": "ok"}')]
    assert len(det.errors) == 1 and det.errors[0].raw == bad.rstrip("\n")
    for pieces in list(chunkings(text))[::7]:
        assert stream_tools(pieces, TOOLS)[:2] == (normal, calls)
    with pytest.raises(ToolCallError):
        DeepSeekV4Detector(strict=True).detect_and_parse(text, TOOLS)


def test_unknown_tool_error_names_it_and_tools_none_skips_checks():
    det = DeepSeekV4Detector()
    det.detect_and_parse(block(BAD_INVOKES["unknown tool"]), TOOLS)
    assert "delete_everything" in str(det.errors[0]) and "get_weather, search" in str(det.errors[0])
    schema_err = DeepSeekV4Detector()
    schema_err.detect_and_parse(block(BAD_INVOKES["schema: wrong type"]), TOOLS)
    assert "days" in schema_err.errors[0].reason and "integer" in schema_err.errors[0].reason
    _, calls = DeepSeekV4Detector().detect_and_parse(block(BAD_INVOKES["unknown tool"]), None)
    assert calls == [ToolCallItem(0, "delete_everything", '{"path": "/"}')]
    assert DeepSeekV4Detector().detect_and_parse(block(invoke("search")), [])[1] == []  # [] = no tool is known


@pytest.mark.parametrize("text,normal", [
    ("A" + block() + "B", "A\n\nB"),  # empty block
    ("A\n\n<｜DSML｜tool_calls>\n" + invoke("search", ("query", "true", "q")).rstrip("\n"), "A"),  # unclosed block
    ("A\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"search\">\n<｜DSML｜param", "A<｜DSML｜invoke name=\"search\">\n<｜DSML｜param"),
    ("A" + block("junk\n" + invoke("search", ("query", "true", "q"))), "Ajunk\n"),  # stray text inside the block
    ("A" + block("<｜DSML｜parameter name=\"q\" string=\"true\">x</｜DSML｜parameter>\n"),
     "A<｜DSML｜parameter name=\"q\" string=\"true\">x</｜DSML｜parameter>\n"),
    ("A\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"search\">" + EOS + "tail", "A<｜DSML｜invoke name=\"search\">"),
])
def test_malformed_blocks(text, normal):
    expected = DeepSeekV4Detector().detect_and_parse(text, TOOLS)
    assert expected[0] == normal
    for pieces in chunkings(text):
        assert stream_tools(pieces, TOOLS)[:2] == expected, pieces


def test_tool_parser_registry_and_schema_check():
    assert get_tool_call_parser("deepseekv4") is DeepSeekV4Detector
    with pytest.raises(ValueError, match="supported: deepseekv4"):
        get_tool_call_parser("qwen25")
    validate_tools(TOOLS)
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    with pytest.raises(ValueError, match="invalid parameters schema"):
        validate_tools(bad)
    with pytest.raises(ValueError, match="'search' is repeated"):
        validate_tools(TOOLS + [TOOLS[-1]])


def test_schema_refs_resolve_locally_and_are_never_fetched(monkeypatch):
    """Local $refs and anchors resolve; one outside the schema is refused by validate_tools and, for a caller that
    skipped it, rejects the call: no URL is opened (jsonschema's default registry would fetch it)."""
    import urllib.request

    opened = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: opened.append(a) or (_ for _ in ()).throw(
        AssertionError("fetched")))
    local = {"type": "object", "$defs": {"n": {"type": "integer"}}, "properties": {
        "a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#anchored"}, "c": {"$anchor": "anchored", "type": "string"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": local}}]
    validate_tools(tools)
    good = block(invoke("f", ("a", "false", "1"), ("b", "true", "x")))
    assert DeepSeekV4Detector().detect_and_parse(good, tools)[1] == [ToolCallItem(0, "f", '{"a": 1, "b": "x"}')]
    det = DeepSeekV4Detector()
    assert det.detect_and_parse(block(invoke("f", ("a", "true", "x"))), tools)[1] == []  # a: integer, by its $ref
    for ref, why in [("http://127.0.0.1:9/s.json", "outside"), ("file:///etc/passwd", "outside"),
                     ("#/$defs/none", "points to nothing"), ("#nowhere", "no .anchor")]:
        remote = [{"type": "function", "function": {"name": "f", "parameters": {"allOf": [{"$ref": ref}]}}}]
        with pytest.raises(ValueError, match=why):
            validate_tools(remote)
        det = DeepSeekV4Detector()
        assert det.detect_and_parse(good, remote)[1] == [] and "cannot be applied" in det.errors[0].reason
    assert not opened


def test_long_argument_streams_without_regrowing_the_buffer():
    """Inside an invoke (or stray text) whose end has not come, chunks are collected, not appended to the buffer
    one by one (that copied it per chunk: 1M characters took 63 s); the result is the non-streaming one."""
    value = "abcd " * 20000
    for text in (block(invoke("search", ("query", "true", value))), "x" + block("junk " * 20000)):
        det = DeepSeekV4Detector()
        pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
        sizes = []
        for piece in pieces[:-40]:
            det.parse_streaming_increment(piece, TOOLS)
            sizes.append(len(det._buf))
        assert len(set(sizes[100:])) == 1 and sizes[100] < 100, sizes[95:105]  # it stopped growing early on
        rest = [det.parse_streaming_increment(p, TOOLS) for p in pieces[-40:]] + [det.flush(TOOLS)]
        assert stream_tools(pieces, TOOLS)[:2] == DeepSeekV4Detector().detect_and_parse(text, TOOLS)
        assert rest


# ---- full pipeline and round trip ------------------------------------------------------------------------------

def test_pipeline_streaming_every_split():
    rp_whole = ReasoningParser(thinking=True)
    reasoning, content = rp_whole.parse_non_stream(P2)
    expected = DeepSeekV4Detector().detect_and_parse(content, TOOLS)
    for pieces in chunkings(P2):
        rp, det = ReasoningParser(thinking=True), DeepSeekV4Detector()
        r_all, normal, calls = "", "", []
        for piece in pieces + [None]:
            r, c = rp.parse_stream_chunk(piece) if piece is not None else rp.flush()
            res = det.parse_streaming_increment(c, TOOLS)
            r_all, normal, calls = r_all + r, normal + res.normal_text, calls + res.calls
        res = det.flush(TOOLS)
        normal, calls = normal + res.normal_text, calls + res.calls
        assert r_all == reasoning and (normal, [ToolCallItem(c.index, c.name, c.arguments) for c in calls]) == expected


def test_encode_then_parse_round_trip():
    calls = [{"id": "1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Zürich \"HB\"\n", "days": 2}}},
             {"id": "2", "type": "function", "function": {"name": "search", "arguments": json.dumps(
                 {"query": "", "filters": {"nested": [1.5, True, None, {"k": "v"}]}})}},
             {"id": "3", "type": "function", "function": {"name": "search", "arguments": "{}"}}]
    prompt = encode_messages([{"role": "user", "content": "go"}, {"role": "assistant", "content": "Sure.",
                                                                  "tool_calls": calls}])
    completion = prompt.split("<｜Assistant｜></think>", 1)[1]
    assert completion == "Sure." + render_tool_calls(calls) + EOS
    normal, parsed = DeepSeekV4Detector().detect_and_parse(completion, TOOLS)
    assert normal == "Sure."
    assert [c.name for c in parsed] == ["get_weather", "search", "search"]
    originals = [c["function"]["arguments"] for c in calls]
    originals = [a if isinstance(a, dict) else json.loads(a) for a in originals]
    assert [json.loads(c.arguments) for c in parsed] == originals
    assert [c.arguments for c in parsed] == [json.dumps(a, ensure_ascii=False) for a in originals]  # byte-equal
