"""DSML tool-call parsing for DeepSeek-V4 (`--tool-call-parser deepseekv4`; spec section 3).

Input is the *content* part of a completion (after the reasoning parser). Grammar, tolerating any whitespace
between tags (the reference insists on single newlines):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="N">
    <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>   (0..n)
    </｜DSML｜invoke>                                                       (1..n invokes)
    </｜DSML｜tool_calls>

Arguments are built as in the reference (Q3): `{json(K): W, ...}` with W = json(V) for string="true" (V kept
verbatim, not stripped) and W = V for string="false", where V must be strict JSON (no NaN, no duplicate keys) and
only surrounding whitespace is removed, so numbers and objects keep the model's spelling. An invoke whose body
is a raw JSON object instead of parameters is accepted too. The blank line before a block is not content.
Text after a block (the reference forbids it; models still write it) is kept as content, as a new paragraph:
its leading whitespace is dropped and a blank line separates it from earlier content (newlines that content
already ends with count toward it), so it is never glued on.

Invalid calls. A call is rejected when its DSML is malformed (bad header, unterminated, duplicate parameter,
bad `string` flag, non-JSON value, stray text inside the block), when `tools` is a list and the name is not in
it (unless SGLANG_FORWARD_UNKNOWN_TOOLS, as upstream: then it is a call, its arguments unchecked), or when its
arguments fail the tool's `function.parameters` JSON Schema. Default (strict=False): a rejected call's raw DSML text
(its invoke, or the stray text) is returned as normal text (the block's own tags are not) and a `ToolCallError`
describing it is added to `errors`; indices count accepted calls only. strict=True raises the ToolCallError instead
(the detector is then unusable). `tools=None` skips name and schema checks. Schemas are checked at request time by
`validate_tools` (ValueError: malformed, or a $ref that does not point inside the schema; nothing is ever fetched);
a schema that fails while a call is checked only rejects the call.

Streaming delta shape: each call is emitted whole, as one ToolCallDelta(index, name, arguments), once its
`</｜DSML｜invoke>` has arrived, because it can only be validated when complete and a streamed call cannot be
taken back. The caller assigns the call id. Text that may be the start of a block marker is held back, so
normal text never carries a partial `<｜DSML｜...`; call `flush()` at the end of the stream.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import referencing

from sglang.srt.parser.reasoning_parser import find_first, partial_marker_len

EOS = "<｜end▁of▁sentence｜>"
BLOCK_START = "<｜DSML｜tool_calls>"
BLOCK_END = "</｜DSML｜tool_calls>"
INVOKE_START = "<｜DSML｜invoke"
INVOKE_END = "</｜DSML｜invoke>"
PARAM_END = "</｜DSML｜parameter>"
_OUTSIDE_MARKERS = ("\n\n" + BLOCK_START, BLOCK_START, EOS)  # the "\n\n" variant wins: it starts earlier
_INVOKE_HEAD = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>')
_END_TAIL = max(map(len, (INVOKE_START, INVOKE_END, BLOCK_END, EOS))) - 1  # may hold the start of a tag in a block
_PARAM_HEAD = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="([^"]*)"\s*>')


@dataclass
class ToolCallItem:
    index: int
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class ToolCallDelta:
    index: int
    name: str | None
    arguments: str


class ToolCallError(ValueError):
    """A tool call the model wrote that could not be accepted."""

    def __init__(self, reason: str, raw: str, name: str | None = None):
        super().__init__(f"invalid tool call{f' to {name!r}' if name else ''}: {reason}")
        self.reason, self.raw, self.name = reason, raw, name


@dataclass
class StreamingParseResult:
    normal_text: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key in JSON object")
    return dict(pairs)


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN/Infinity and duplicate object keys."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)


def _tool_functions(tools: list) -> dict:
    out = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"each tool needs a function object with a string name, got {tool!r}")
        out[fn["name"]] = fn
    return out


# $refs resolve inside the schema only: an empty registry never retrieves, so a client's schema cannot make the
# server fetch a URL or read a file (jsonschema's default would).
_NO_RETRIEVAL = referencing.Registry()
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: a "$ref" inside is data


def _keyword_strings(schema, key: str) -> list:
    """Every string value of `key` (e.g. "$ref", "$anchor") in a schema's subschemas (not inside data keywords)."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get(key), str):
                found.append(node[key])
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _check_ref(schema, anchors: set, ref: str) -> str | None:
    """Why `ref` cannot be used (None: it points inside the schema): only local JSON pointers and the schema's
    `anchors` are."""
    if not ref.startswith("#"):
        return f"$ref {ref!r} points outside the schema (only local references such as '#/$defs/x' are supported)"
    if ref in ("#", "#/"):
        return None
    if not ref.startswith("#/"):
        return None if ref[1:] in anchors else f"$ref {ref!r} names no $anchor of the schema"
    node = schema
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return f"$ref {ref!r} points to nothing in the schema"
    return None


def _validator(fn: dict):
    schema = fn.get("parameters")
    if schema is None:
        return None
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"tool {fn['name']!r} has an invalid parameters schema: {e.message}") from None
    anchors = set(_keyword_strings(schema, "$anchor"))
    problem = next((p for ref in _keyword_strings(schema, "$ref") if (p := _check_ref(schema, anchors, ref))), None)
    if problem is not None:
        raise ValueError(f"tool {fn['name']!r} has an invalid parameters schema: {problem}")
    return cls(schema, registry=_NO_RETRIEVAL)


def validate_tools(tools: list | None) -> None:
    """Request-time check of tool names and schemas (raises ValueError naming the tool), so parsing never hits a bad
    schema."""
    functions = _tool_functions(tools or [])
    if len(functions) < len(tools or []):
        names = [(t.get("function", t) or {}).get("name") for t in tools]
        raise ValueError(f"tool names must be unique; {next(n for n in names if names.count(n) > 1)!r} is repeated")
    for fn in functions.values():
        _validator(fn)


def parse_invoke(raw: str) -> tuple[str, dict, str]:
    """One complete `<｜DSML｜invoke ...>...</｜DSML｜invoke>` -> (name, parsed arguments, arguments text).
    Raises ToolCallError on malformed DSML."""
    head = _INVOKE_HEAD.match(raw)
    if head is None or not head.group(1):
        raise ToolCallError('malformed invoke header (expected <｜DSML｜invoke name="...">)', raw)
    name = head.group(1)
    body = raw[head.end():len(raw) - len(INVOKE_END)]
    if body.strip().startswith("{"):  # raw-JSON body instead of parameters
        try:
            args = strict_json(body)
        except ValueError as e:
            raise ToolCallError(f"invoke body is not a valid JSON object: {e}", raw, name) from None
        if not isinstance(args, dict):
            raise ToolCallError("invoke body must be a JSON object", raw, name)
        return name, args, body.strip()
    args, parts, pos = {}, [], 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            break
        param = _PARAM_HEAD.match(body, pos)
        if param is None:
            raise ToolCallError(f"unexpected text in invoke: {body[pos:pos + 40]!r}", raw, name)
        key, flag = param.group(1), param.group(2)
        end = body.find(PARAM_END, param.end())
        if end < 0:
            raise ToolCallError(f"parameter {key!r} is not closed", raw, name)
        if key in args:
            raise ToolCallError(f"duplicate parameter {key!r}", raw, name)
        value = body[param.end():end]
        if flag == "true":
            args[key], text = value, json.dumps(value, ensure_ascii=False)
        elif flag == "false":
            text = value.strip()
            try:
                args[key] = strict_json(text)
            except ValueError as e:
                raise ToolCallError(f"parameter {key!r} has string=\"false\" but is not JSON: {e}", raw, name) from None
        else:
            raise ToolCallError(f'parameter {key!r} has string="{flag}" (expected true or false)', raw, name)
        parts.append(json.dumps(key, ensure_ascii=False) + ": " + text)
        pos = end + len(PARAM_END)
    return name, args, "{" + ", ".join(parts) + "}"


class DeepSeekV4Detector:
    """One instance per response for streaming; `detect_and_parse` does not touch the streaming state."""

    def __init__(self, strict: bool = False, forward_unknown: bool | None = None):
        from sglang.srt.environ import envs

        self.strict = strict
        # a call to a tool the request did not offer: rejected, or (SGLANG_FORWARD_UNKNOWN_TOOLS, as upstream)
        # returned as a call, its arguments unchecked
        self.forward_unknown = envs.SGLANG_FORWARD_UNKNOWN_TOOLS.get() if forward_unknown is None else forward_unknown
        self.errors: list[ToolCallError] = []  # every rejection seen by this instance
        self._buf = ""
        self._in_block = False
        self._done = False
        self._next_index = 0
        self._seen = 0  # block state: buffer prefix already searched for the invoke end / EOS (long arguments)
        self._tail = None  # the last two characters of normal text returned (None: none returned yet)
        self._after_block = False  # outside, right after a block: the next text starts a new paragraph
        # Inside a block, while the buffer waits for a tag (an invoke's end, or the tag after stray text), new text
        # is only collected (appending to _buf would copy it for every chunk: quadratic in a long argument) and
        # searched, with the tail before it, for what it waits for.
        self._pending: list[str] = []
        self._pending_tail = ""

    @staticmethod
    def has_tool_call(text: str) -> bool:
        return BLOCK_START in text

    def detect_and_parse(self, text: str, tools: list | None) -> tuple[str, list[ToolCallItem]]:
        """Whole-completion parse: (normal_text, accepted calls)."""
        scanner = DeepSeekV4Detector(strict=self.strict, forward_unknown=self.forward_unknown)
        first = scanner.parse_streaming_increment(text, tools)
        last = scanner.flush(tools)
        self.errors.extend(scanner.errors)
        calls = [ToolCallItem(c.index, c.name, c.arguments) for c in first.calls + last.calls]
        return first.normal_text + last.normal_text, calls

    def parse_streaming_increment(self, delta_text: str, tools: list | None) -> StreamingParseResult:
        result = StreamingParseResult()
        if self._done:
            return result
        waiting = self._waiting_for()
        if waiting:
            window = self._pending_tail + delta_text
            if not any(marker in window for marker in waiting):
                self._pending.append(delta_text)
                self._pending_tail = window[-_END_TAIL:]
                return result
        self._buf += "".join(self._pending) + delta_text
        self._pending.clear()
        self._drain(tools, result, final=False)
        if self._waiting_for():
            self._pending_tail = self._buf[-_END_TAIL:]
        return result

    def flush(self, tools: list | None) -> StreamingParseResult:
        """End of stream: release held-back text; an unterminated call is rejected. Later input is ignored."""
        result = StreamingParseResult()
        if not self._done:
            self._buf += "".join(self._pending)
            self._pending.clear()
            self._drain(tools, result, final=True)
            self._done = True
        return result

    def _waiting_for(self) -> tuple:
        """Inside a block, when the last drain searched the whole buffer in vain: the markers it waits for (an
        invoke's end, or the tag that ends stray text; EOS either way), else ()."""
        if not (self._in_block and self._seen == len(self._buf) > 0):
            return ()
        return (INVOKE_END, EOS) if self._buf.startswith(INVOKE_START) else (INVOKE_START, BLOCK_END, EOS)

    def _drain(self, tools: list | None, out: StreamingParseResult, final: bool) -> None:
        while True:
            if not self._in_block:
                pos, marker = find_first(self._buf, _OUTSIDE_MARKERS)
                if marker is None:
                    keep = 0 if final else partial_marker_len(self._buf, _OUTSIDE_MARKERS)
                    self._emit(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._emit(self._buf[:pos], out)
                if marker == EOS:
                    self._buf, self._done = "", True
                    return
                self._buf, self._in_block, self._seen = self._buf[pos + len(marker):], True, 0
                self._after_block = False
                continue
            eos = self._buf.find(EOS, max(0, self._seen - len(EOS)))
            if eos >= 0:  # end of output inside a block: finish with what came before
                self._buf, self._done, final = self._buf[:eos], True, True
            if self._buf[:1].isspace():
                self._buf, self._seen = self._buf.lstrip(), 0
            if not self._buf:
                return
            if self._buf.startswith(BLOCK_END):
                self._buf, self._in_block, self._seen = self._buf[len(BLOCK_END):], False, 0
                self._after_block = True
                continue
            if self._buf.startswith(INVOKE_START):
                end = self._buf.find(INVOKE_END, max(0, self._seen - len(INVOKE_END)))
                if end < 0:
                    if final:
                        self._reject(ToolCallError("invoke is not closed", self._buf), out)
                        self._buf = ""
                    self._seen = len(self._buf)
                    return
                raw, self._buf = self._buf[:end + len(INVOKE_END)], self._buf[end + len(INVOKE_END):]
                self._seen = 0
                self._accept(raw, tools, out)
                continue
            if not final and (BLOCK_END.startswith(self._buf) or INVOKE_START.startswith(self._buf)):
                return  # a tag is still arriving
            start = max(1, self._seen - _END_TAIL)
            hits = [i for i in (self._buf.find(tag, start) for tag in (INVOKE_START, BLOCK_END)) if i >= 0]
            pos = min(hits) if hits else -1
            if pos < 0 and not final:
                self._seen = len(self._buf)
                return  # stray text runs until the next tag, which has not arrived yet
            stray = self._buf if pos < 0 else self._buf[:pos]
            self._buf, self._seen = self._buf[len(stray):], 0
            self._reject(ToolCallError(f"unexpected text inside the tool_calls block: {stray[:40]!r}", stray), out)

    def _emit(self, text: str, out: StreamingParseResult) -> None:
        """Return normal text. Text after a block is a new paragraph: its leading whitespace is dropped and, when
        text came before the block, a blank line separates them (the newlines that earlier text already ends
        with count), so "before" + block + "after" reads "before\\n\\nafter", never "beforeafter"."""
        if self._after_block:
            text = text.lstrip()
            if not text:
                return  # whitespace only so far: wait for real text (dropped at the end of the output)
            if self._tail is not None:
                text = "\n" * (2 - (len(self._tail) - len(self._tail.rstrip("\n")))) + text
            self._after_block = False
        if text:
            out.normal_text += text
            self._tail = ((self._tail or "") + text)[-2:]

    def _accept(self, raw: str, tools: list | None, out: StreamingParseResult) -> None:
        try:
            name, args, arguments = parse_invoke(raw)
            if tools is not None:
                functions = _tool_functions(tools)
                if name not in functions and self.forward_unknown:
                    functions = {name: {}}  # no schema: its arguments go as written
                if name not in functions:
                    known = ", ".join(functions) or "none"
                    raise ToolCallError(f"unknown tool (available: {known})", raw, name)
                try:
                    validator = _validator(functions[name])
                    problem = (None if validator is None else
                               jsonschema.exceptions.best_match(validator.iter_errors(args)))
                except Exception as e:  # a schema validate_tools did not vet (a direct caller): reject, never crash
                    raise ToolCallError(f"the tool's schema cannot be applied: {e}", raw, name) from None
                if problem is not None:
                    where = "/".join(str(p) for p in problem.absolute_path) or "arguments"
                    raise ToolCallError(f"{where}: {problem.message}", raw, name)
        except ToolCallError as e:
            self._reject(e, out)
            return
        out.calls.append(ToolCallDelta(self._next_index, name, arguments))
        self._next_index += 1

    def _reject(self, error: ToolCallError, out: StreamingParseResult) -> None:
        self.errors.append(error)
        if self.strict:
            raise error
        out.errors.append(error)
        self._emit(error.raw, out)
