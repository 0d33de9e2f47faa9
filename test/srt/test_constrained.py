"""Constrained decoding with xgrammar on the built-in tiny model (random weights, the real vocabulary): at temperature
1 every output under a JSON schema (enums, booleans, integers in a range, nested objects, arrays) parses and
validates, regex outputs match, EBNF outputs derive; bad grammars (not compiling, or matching nothing) are refused
naming the field, one that dead-ends after a prefix ends the request as a client error; greedy speculative
decoding with a grammar equals plain decoding with it; a constrained request among unconstrained ones leaves theirs
unchanged; a failed step rolls the grammar back with the tokens."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest

import sglang
from oracle import DEVICE

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
                  "required": ["flag", "level"], "additionalProperties": False},
    },
    "required": ["color", "ok", "count", "tags", "inner"],
    "additionalProperties": False,
}
REGEX = r"(yes|no) [0-9]{2}-[a-c]{1,3}!"
EBNF = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= "x" | "yy" | "[" digit "]"\ndigit ::= [0-9]'
EBNF_LANGUAGE = r"\((x|yy|\[[0-9]\])(,(x|yy|\[[0-9]\])){0,2}\)"


@functools.lru_cache(maxsize=None)
def tiny(**kwargs):
    return sglang.Engine(model_path="tiny-deepseek-v4", device=DEVICE, dtype="float32", log_level="warning",
                         max_running_requests=16, context_length=1024, **kwargs)


def _sampled(field: str, value: str, n: int = 8, max_new: int = 160, complete: bool = True) -> list:
    params = [{"temperature": 1.0, "max_new_tokens": max_new, "seed": 7 + i, field: value} for i in range(n)]
    outs = tiny().generate(input_ids=[[5, 17, 300 + i] for i in range(n)], sampling_params=params)
    for out in outs:
        if complete:  # the grammar completed, then EOS
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    return [out["text"] for out in outs]


def test_json_schema_outputs_parse_and_validate():
    texts = _sampled("json_schema", json.dumps(SCHEMA))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert not re.search(r"\s", text)  # compact JSON: no whitespace to pad with
    assert len(set(texts)) > 1  # temperature 1: really sampled


def test_any_json_regex_and_ebnf():
    # any JSON (an object or an array, compact): random weights write strings that rarely close, so the outputs are
    # checked as grammar prefixes
    for text in _sampled("json_schema", "$$ANY$$", n=4, max_new=40, complete=False):
        assert text[0] in "{[" and tiny().scheduler.grammar_backend.matcher(
            "json_schema", "$$ANY$$").accept_string(text), text
    backend = tiny().scheduler._grammar()
    assert backend.matcher("json_schema", "$$ANY$$").accept_string('[1,{"a":null}]')
    assert not backend.matcher("json_schema", "$$ANY$$").accept_string("[1, 2]")  # no whitespace to pad with
    for text in _sampled("regex", REGEX):
        assert re.fullmatch(REGEX, text), text
    for text in _sampled("ebnf", EBNF):
        assert re.fullmatch(EBNF_LANGUAGE, text), text


@pytest.mark.parametrize("field, value, message", [
    ("regex", "(ab", "regex does not compile"),
    ("json_schema", "{not json", "json_schema does not compile"),
    ("ebnf", "root ::= undefined_rule", "ebnf does not compile"),
    ("json_schema", "", "must be a non-empty string"),
    ("regex", r"[^\s\S]", "regex matches no text"),  # compiles, allows nothing
    ("ebnf", r"root ::= [^\x00-\U0010FFFF]", "ebnf matches no text"),
])
def test_bad_grammar_is_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny().generate(input_ids=[1, 2, 3], sampling_params={field: value, "max_new_tokens": 4})
    with pytest.raises(ValueError, match="cannot be combined"):
        tiny().generate(input_ids=[1, 2, 3], sampling_params={"regex": "a", "ebnf": 'root ::= "a"'})
    tiny().model_runner.token_allocator.check_all_free()


@pytest.mark.parametrize("field, value", [("regex", r"a[^\s\S]"),
                                          ("json_schema", json.dumps({"type": "string", "pattern": r"[^\s\S]"}))])
def test_grammar_dead_end_aborts_as_client_error(field, value):
    """A grammar that allows a first token but no complete text: the request ends with a 400 abort at the dead end
    (not a 500), its slots freed."""
    out = tiny().generate(input_ids=[1, 2, 3], sampling_params={field: value, "max_new_tokens": 8, "temperature": 1.0})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400 and "cannot be completed" in reason["message"]
    assert len(out["output_ids"]) == 1  # the one allowed token; the drawn one the grammar refused is not recorded
    assert "after 1 generated tokens" in reason["message"]
    tiny().model_runner.token_allocator.check_all_free()


def test_grammar_backend_none_refuses():
    eng = sglang.Engine(model_path="tiny-deepseek-v4", device=DEVICE, log_level="warning", max_running_requests=2,
                        context_length=256, grammar_backend="none")
    with pytest.raises(ValueError, match="grammar-backend none"):
        eng.generate(input_ids=[1, 2, 3], sampling_params={"regex": "a+"})


def test_constrained_among_unconstrained():
    """A constrained request batched with plain ones: theirs equal their solo outputs (its batches run without
    overlap), its own matches."""
    plain = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    prompts = [[9, 8, 7], [100, 200, 300, 400], [5, 5]]
    solo = [tiny().generate(input_ids=p, sampling_params=plain)["output_ids"] for p in prompts]
    params = [plain, {"temperature": 0, "max_new_tokens": 40, "regex": REGEX}, plain]
    outs = tiny().generate(input_ids=prompts, sampling_params=params)
    assert outs[0]["output_ids"] == solo[0] and outs[2]["output_ids"] == solo[2]
    assert re.fullmatch(REGEX, outs[1]["text"])


def test_greedy_speculative_with_grammar_equals_plain():
    """Three draft steps: each verify's grammar accepts and rolls back anywhere from none to all three draft tokens,
    which includes the single token of a one-step draft (no grammar or verify code depends on the step count)."""
    spec = tiny(speculative_algorithm="EAGLE", speculative_num_steps=3)
    prompts = [[5, 17, 300 + i] for i in range(4)]
    params = [{"temperature": 0, "max_new_tokens": 120, "json_schema": json.dumps(SCHEMA)},
              {"temperature": 0, "max_new_tokens": 40, "regex": REGEX},
              {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 80, "ebnf": EBNF}]
    ref = tiny().generate(input_ids=prompts, sampling_params=params)
    got = spec.generate(input_ids=prompts, sampling_params=params)
    for a, b in zip(got, ref):
        assert a["output_ids"] == b["output_ids"]
    jsonschema.validate(json.loads(got[0]["text"]), SCHEMA)
    spec.model_runner.token_allocator.check_all_free()


def test_failed_step_rolls_the_grammar_back(monkeypatch):
    """A speculative cycle that raises after committing its tokens (in draft-extend) is undone and its requests run
    again one by one (step isolation): the grammar states go back with the tokens, so the outputs are those of a run
    without the failure."""
    spec = tiny(speculative_algorithm="EAGLE", speculative_num_steps=2)
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    params = [{"temperature": 0, "max_new_tokens": 40, "regex": REGEX},
              {"temperature": 0, "max_new_tokens": 120, "json_schema": json.dumps(SCHEMA)}]
    ref = [o["output_ids"] for o in tiny().generate(input_ids=prompts, sampling_params=params)]
    worker, calls = spec.scheduler.worker, {"n": 0}
    original = worker.draft_extend

    def flaky(verified):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure after the commit")
        return original(verified)

    monkeypatch.setattr(worker, "draft_extend", flaky)
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert calls["n"] > 3
    assert [o["output_ids"] for o in outs] == ref
    assert re.fullmatch(REGEX, outs[0]["text"]) and jsonschema.validate(json.loads(outs[1]["text"]), SCHEMA) is None
    spec.model_runner.token_allocator.check_all_free()


def test_undone_dead_end_keeps_grammar_and_tokens_in_step(monkeypatch):
    """A request failing once while the step's tokens are committed, after a dead-ending request drew its refused token
    in that step: the step is undone and run again; the dead-ending request still ends with its one allowed token and a
    400 (the refused token was never recorded, so the undo rolls the grammar back by exactly the tokens it took)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    eng = tiny()
    sched = eng.scheduler
    dead = Req(rid="dead-end", origin_input_ids=[1, 2, 3], sampling_params=SamplingParams.from_dict(
        {"regex": r"a[^\s\S]", "max_new_tokens": 8, "temperature": 1.0}))
    culprit = Req(rid="culprit", origin_input_ids=[4, 5, 6], sampling_params=SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}))
    failures, real_append = [], sched.append_token

    def append(req, *rest):
        if req is culprit and dead.finished_reason is not None and not failures:  # `dead` drew past its end
            failures.append(dead.finished_reason)
            raise RuntimeError("injected failure at commit")
        return real_append(req, *rest)

    monkeypatch.setattr(sched, "append_token", append)
    sched.add_request(dead)
    sched.add_request(culprit)  # behind `dead` in the batch: `dead` got its token before the failure
    for _ in range(100):
        if not sched.has_work():
            break
        sched.step()
    assert failures and failures[0].status_code == 400  # it had reached its dead end in the failed step
    assert dead.finished_reason.status_code == 400 and len(dead.output_ids) == 1
    assert culprit.finished_reason.type == "length"  # it failed once: its rerun served
    eng.model_runner.token_allocator.check_all_free()


def test_json_after_reasoning_grammar():
    """Thinking mode + response_format: free reasoning up to </think>, then the schema's JSON."""
    from sglang.srt.constrained.xgrammar_backend import json_after_reasoning

    backend = tiny().scheduler._grammar()
    ebnf = json_after_reasoning(json.dumps(SCHEMA))
    good = 'Colors: <b>red? a<3, fine.</think>{"color":"red","ok":true,"count":7,"tags":["a"],' \
           '"inner":{"flag":false,"level":3}}'
    matcher = backend.matcher("ebnf", ebnf)
    assert matcher.accept_string(good) and matcher.is_completed()
    assert not backend.matcher("ebnf", ebnf).accept_string('</think>{"color":"pink"')
    early = backend.matcher("ebnf", ebnf)  # JSON before </think> is still reasoning: nothing is complete
    assert early.accept_string('{"color":"red","ok":true}') and not early.is_completed()
    with pytest.raises(ValueError, match="does not compile"):
        json_after_reasoning('{"type": 5}')


def _json_object_grammar(thinking: bool) -> tuple:
    """(field, value) of the grammar response_format json_object sets (chat, /v1/completions, /v1/responses'
    text.format)."""
    from sglang.srt.entrypoints.openai.serving_base import response_format_grammar

    ((field, value),) = response_format_grammar({"type": "json_object"}, thinking).items()
    return field, value


def test_json_object_is_a_compact_object():
    """response_format json_object means any JSON object (as OpenAI and upstream SGLang), compact: never an array or
    a scalar, no whitespace between tokens. At temperature 1 on random weights each of 20 outputs is a whole object
    (the grammar completed) or, cut by max_new_tokens inside a string the model never closes, a prefix of one."""
    field, value = _json_object_grammar(thinking=False)
    backend = tiny().scheduler._grammar()

    def complete(text):
        matcher = backend.matcher(field, value)
        return matcher.accept_string(text) and matcher.is_completed()

    assert complete("{}") and complete('{"a":[1,{"b":null}],"c":"x y","d":-2.5e3,"e":true}')
    for text in ("[]", "[false]", '"s"', "1", "true", "null", "{ }", '{"a": 1}', '{"a":1 }', '{"a":1,"b":2}\n'):
        assert not complete(text), text
    n = 20
    params = [{"temperature": 1.0, "max_new_tokens": 48, "seed": 7 + i, field: value} for i in range(n)]
    outs = tiny().generate(input_ids=[[5, 17, 300 + i] for i in range(n)], sampling_params=params)
    completed = 0
    for out in outs:
        text = out["text"]
        if out["meta_info"]["finish_reason"]["type"] == "stop":  # the grammar completed, then EOS
            assert isinstance(json.loads(text), dict), text
            completed += 1
        else:
            assert text.startswith('{"') and backend.matcher(field, value).accept_string(text), text
    assert completed  # some objects close (these seeds: 10 of 20)
    # thinking mode: the reasoning runs free up to </think>, then the object follows, compact
    field, value = _json_object_grammar(thinking=True)
    assert field == "ebnf"
    for text, ok in (('Plan: {"a": [1]}.</think>{"a":[1]}', True), ("r</think>[1]", False),
                     ("r</think>{ }", False), ("r</think>7", False)):
        matcher = backend.matcher(field, value)
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "detail": {"type": "object", "properties": {"wind": {"type": "boolean"}}, "required": ["wind"],
                       "additionalProperties": False}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.mark.parametrize("name", [None, "get_weather"])
def test_forced_tool_calls_parse_with_valid_arguments(name):
    """tool_choice "required" / a named function: at temperature 1 every completion is one DSML call that the
    deepseekv4 parser reads, of an allowed tool, with arguments that validate against its schema. "required" takes 8
    samples (every tool must come up, get_weather's arguments validated among them); the named function 4, each of
    which must name it."""
    from sglang.srt.constrained.tool_call_grammar import tool_call_ebnf
    from sglang.srt.function_call import get_tool_call_parser

    texts = _forced_call_texts()[(None, name)]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    seen = set()
    for text in texts:
        normal, calls = get_tool_call_parser("deepseekv4")().detect_and_parse(text, TOOLS)
        assert not normal.strip() and len(calls) == 1, text
        call = calls[0]
        assert call.name in ({name} if name else set(schemas)), text
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        seen.add(call.name)
    if name is None:
        assert seen == set(schemas)  # "required" lets the model pick any tool
    with pytest.raises(ValueError, match="not in tools"):
        tool_call_ebnf(TOOLS, "nope", thinking=False)


HARD_TOOLS = [  # schemas the parameter-by-parameter grammar cannot carry alone (found by fuzzing against the parser)
    {"type": "function", "function": {"name": "zip", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "c": {"type": "string", "const": "x"}},
        "required": ["zip", "c"]}}},
    {"type": "function", "function": {"name": "any_of", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 4}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "min_props", "parameters": {"type": "object", "properties": {
        "a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}, "minProperties": 2,
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "refs", "parameters": {"type": "object", "$defs": {
        "day": {"enum": ["mon", "tue"]}}, "properties": {"day": {"$ref": "#/$defs/day"}, 'say "hi"': {
            "type": "boolean"}}, "required": ["day", 'say "hi"'], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "extra_required", "parameters": {
        "type": "object", "required": ["k"], "additionalProperties": {"type": "boolean"}}}},
]


@pytest.mark.parametrize("name", [t["function"]["name"] for t in HARD_TOOLS])
def test_forced_calls_validate_for_object_level_keywords(name):
    """Patterns, consts, anyOf / minProperties, $ref, quoted keys and required keys outside properties: the forced
    call still parses and validates (string keywords become JSON values under their schema; object-level ones make
    the invoke body one JSON object under the whole schema)."""
    from sglang.srt.function_call import get_tool_call_parser

    texts = _forced_call_texts()[("hard", name)]
    schema = next(t["function"]["parameters"] for t in HARD_TOOLS if t["function"]["name"] == name)
    for text in texts:
        det = get_tool_call_parser("deepseekv4")()
        normal, calls = det.detect_and_parse(text, HARD_TOOLS)
        assert not normal.strip() and len(calls) == 1 and calls[0].name == name, (text, det.errors)
        jsonschema.validate(json.loads(calls[0].arguments), schema)


@functools.lru_cache(maxsize=1)
def _forced_call_texts() -> dict:
    """Every forced-call test's samples, (tools, name) -> texts, decoded together: each request runs its own grammar
    (seeds and prompts as _sampled gives them per grammar), so the 7 grammars' 36 requests share their decode steps
    instead of taking 7 runs of up to 200 steps each (the tests above check each grammar's texts as before)."""
    from sglang.srt.constrained.tool_call_grammar import tool_call_ebnf

    groups = [((None, name), tool_call_ebnf(TOOLS, name, thinking=False), 4 if name else 8)
              for name in (None, "get_weather")]
    groups += [(("hard", t["function"]["name"]), tool_call_ebnf(HARD_TOOLS, t["function"]["name"], thinking=False), 4)
               for t in HARD_TOOLS]
    ids, params, keys = [], [], []
    for key, ebnf, n in groups:
        ids += [[5, 17, 300 + i] for i in range(n)]
        params += [{"temperature": 1.0, "max_new_tokens": 200, "seed": 7 + i, "ebnf": ebnf} for i in range(n)]
        keys += [key] * n
    texts = {key: [] for key, _, _ in groups}
    for key, out in zip(keys, tiny().generate(input_ids=ids, sampling_params=params)):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out  # the grammar completed, then EOS
        texts[key].append(out["text"])
    return texts
