"""The grammar of a forced DeepSeek-V4 tool call (OpenAI `tool_choice` "required" or a named function).

The completion is exactly one DSML block (docs: dsv4-encoding.md R7), then EOS:

    \\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="NAME">\\n
    <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>\\n   (each parameter)
    </｜DSML｜invoke>\\n</｜DSML｜tool_calls>

NAME is the named function, or any of the tools for "required". The parameters are the tool's schema properties in
schema order, the required ones always and the others optionally. A plain string property is written raw
(string="true": text without "<", within minLength / maxLength, or one of its enum values); any other, a string with
a pattern, format or const included, is JSON under its own schema (string="false"). A schema whose constraints
parameters cannot carry one by one (object-level keywords such as anyOf or minProperties, $ref / $defs, a key with
a double quote) takes the invoke body as one JSON object under the whole schema instead, which the parser reads as
well; object-level allOf / anyOf / oneOf are first merged with the object's own keywords, and required keys that are
not properties listed as properties (`_enforceable`: xgrammar skips both). So the tool-call parser reads a call
whose arguments validate against the tool's schema, up to the keywords xgrammar does not enforce (as for
response_format: `not`, `if`, `patternProperties`, ...). In thinking mode the reasoning runs free up to </think>
first. Built from xgrammar Grammar pieces and returned as EBNF text (the `ebnf` sampling field).
"""

from __future__ import annotations

import json
from typing import Optional

from sglang.srt.constrained.xgrammar_backend import REASONING_EBNF

BLOCK_START = "\n\n<｜DSML｜tool_calls>\n"
BLOCK_END = "\n</｜DSML｜tool_calls>"


def _lit(xgr, text: str):
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


# Keywords the DSML parameter form carries: the object's own (each property is then checked under its own schema) ...
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema",
                "$comment", "examples", "default"}
# ... and a string written raw (string="true"); any other string keyword makes it JSON under its schema
_RAW_STRING_KEYS = {"type", "enum", "minLength", "maxLength", "description", "title", "examples", "default"}


def _parameter_form(params: dict) -> bool:
    """Whether one DSML parameter per property, each under its own schema, enforces the whole schema."""
    props = params.get("properties") or {}
    return (set(params) <= _OBJECT_KEYS and params.get("type", "object") == "object" and isinstance(props, dict)
            and set(params.get("required") or []) <= set(props) and all(isinstance(v, dict) for v in props.values())
            and not any('"' in k for k in props) and '"$ref"' not in json.dumps(params))


_MERGEABLE = {"type", "properties", "required", "additionalProperties", "minProperties", "maxProperties",
              "description", "title"}


def _merged(base: dict, extra) -> Optional[dict]:
    """One object schema that holds when both do, or None when that is more than a union of plain keywords."""
    if not isinstance(extra, dict) or not set(extra) <= _MERGEABLE or extra.get("type", "object") != "object":
        return None
    out, props = dict(base), dict(base.get("properties") or {})
    for key, sub in (extra.get("properties") or {}).items():
        if props.get(key, sub) != sub:
            return None
        props[key] = sub
    if props:
        out["properties"] = props
    if extra.get("required"):
        out["required"] = list(dict.fromkeys([*(base.get("required") or []), *extra["required"]]))
    if "additionalProperties" in extra:
        if base.get("additionalProperties", extra["additionalProperties"]) != extra["additionalProperties"]:
            return None
        out["additionalProperties"] = extra["additionalProperties"]
    for key, pick in (("minProperties", max), ("maxProperties", min)):
        if key in extra:
            out[key] = pick(base[key], extra[key]) if key in base else extra[key]
    return out


def _enforceable(params: dict) -> dict:
    """The schema in a shape xgrammar enforces (it skips object-level combinators beside properties, and required
    keys that are not properties): allOf merged in; anyOf / oneOf as an anyOf of the object with each branch merged
    in (oneOf then also allows what several branches match); required keys listed as properties (under
    additionalProperties' schema). Left as it is where merging is not a plain union."""
    out = dict(params)
    if "allOf" in out:
        merged = dict(out, allOf=None)
        for branch in out["allOf"] if isinstance(out["allOf"], list) else [None]:
            merged = merged and _merged(merged, branch)
        if merged:
            out = {k: v for k, v in merged.items() if k != "allOf"}
    for key in ("anyOf", "oneOf"):
        if key in out and isinstance(out[key], list):
            base = {k: v for k, v in out.items() if k not in ("anyOf", "oneOf")}
            branches = [_merged(base, b) for b in out[key]]
            if all(branches) and not ("anyOf" in out and "oneOf" in out):
                return {"anyOf": [_enforceable(b) for b in branches]}
    props = out.get("properties")
    missing = [k for k in out.get("required") or [] if k not in (props or {})]
    extra = out.get("additionalProperties", {})
    if missing and isinstance(props or {}, dict) and extra is not False:
        out["properties"] = {**(props or {}), **{k: extra if isinstance(extra, dict) else {} for k in missing}}
    return out


def _json(xgr, schema):
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))


def _string_value(xgr, schema: dict):
    if "enum" in schema:
        return xgr.Grammar.union(*(_lit(xgr, str(v)) for v in schema["enum"]))
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    reps = f"{{{low},{int(high)}}}" if high is not None else (f"{{{low},}}" if low else "*")
    return xgr.Grammar.from_ebnf(f"root ::= [^<]{reps}")


def _parameter(xgr, key: str, schema: dict):
    raw = schema.get("type") == "string" and set(schema) <= _RAW_STRING_KEYS
    value = _string_value(xgr, schema) if raw else _json(xgr, schema)
    flag = "true" if raw else "false"
    return xgr.Grammar.concat(_lit(xgr, f'<｜DSML｜parameter name="{key}" string="{flag}">'), value,
                              _lit(xgr, "</｜DSML｜parameter>\n"))


def _invoke(xgr, function: dict):
    name = function["name"]
    params = _enforceable(function.get("parameters") or {})
    props = params.get("properties") or {}
    head = _lit(xgr, f'<｜DSML｜invoke name="{name}">\n')
    if not _parameter_form(params):  # the body as one JSON object under the whole schema
        return xgr.Grammar.concat(head, _json(xgr, params), _lit(xgr, "\n</｜DSML｜invoke>"))
    if not props:
        return xgr.Grammar.concat(head, _lit(xgr, "\n</｜DSML｜invoke>"))
    required, empty = set(params.get("required") or []), xgr.Grammar.from_ebnf('root ::= ""')
    parts = [head]
    for key, schema in props.items():
        param = _parameter(xgr, key, schema)
        parts.append(param if key in required else xgr.Grammar.union(param, empty))
    parts.append(_lit(xgr, "</｜DSML｜invoke>"))
    return xgr.Grammar.concat(*parts)


def tool_call_ebnf(tools: list, name: Optional[str], thinking: bool) -> str:
    """EBNF of one forced call of `name` (or of any of `tools` when None); ValueError when a tool's schema does not
    convert or `name` is not a tool."""
    import xgrammar as xgr

    functions = [t["function"] for t in tools]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    try:
        invokes = [_invoke(xgr, f) for f in functions]
        block = xgr.Grammar.concat(_lit(xgr, BLOCK_START), xgr.Grammar.union(*invokes), _lit(xgr, BLOCK_END))
        if thinking:
            block = xgr.Grammar.concat(xgr.Grammar.from_ebnf(REASONING_EBNF), block)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"a tool's parameters schema does not compile: {str(e).strip().splitlines()[-1]}") from None
    return str(block)
