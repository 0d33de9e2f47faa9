"""The grammar of a forced DeepSeek-V4 tool call (OpenAI `tool_choice` "required" or a named function).

The completion is exactly one DSML block (docs: dsv4-encoding.md R7), then EOS:

    \\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="NAME">\\n
    <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>\\n   (each parameter)
    </｜DSML｜invoke>\\n</｜DSML｜tool_calls>

NAME is the named function, or any of the tools for "required". The parameters are the tool's schema properties in
schema order, the required ones always and the others optionally. A string property is written raw (string="true":
text without "<", within minLength / maxLength, or one of its enum values); any other is JSON under its own schema
(string="false"). So the tool-call parser reads a call whose arguments validate against the tool's schema. In
thinking mode the reasoning runs free up to </think> first. Built from xgrammar Grammar pieces and returned as EBNF
text (the `ebnf` sampling field).
"""

from __future__ import annotations

import json
from typing import Optional

from sglang.srt.constrained.xgrammar_backend import REASONING_EBNF

BLOCK_START = "\n\n<｜DSML｜tool_calls>\n"
BLOCK_END = "\n</｜DSML｜tool_calls>"


def _lit(xgr, text: str):
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def _string_value(xgr, schema: dict):
    if "enum" in schema:
        return xgr.Grammar.union(*(_lit(xgr, str(v)) for v in schema["enum"]))
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    reps = f"{{{low},{int(high)}}}" if high is not None else (f"{{{low},}}" if low else "*")
    return xgr.Grammar.from_ebnf(f"root ::= [^<]{reps}")


def _parameter(xgr, key: str, schema: dict):
    raw = schema.get("type") == "string"
    value = (_string_value(xgr, schema) if raw else
             xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": ")))
    flag = "true" if raw else "false"
    return xgr.Grammar.concat(_lit(xgr, f'<｜DSML｜parameter name="{key}" string="{flag}">'), value,
                              _lit(xgr, "</｜DSML｜parameter>\n"))


def _invoke(xgr, function: dict):
    name, params = function["name"], function.get("parameters") or {}
    props = params.get("properties") or {}
    head = _lit(xgr, f'<｜DSML｜invoke name="{name}">\n')
    if not props:
        return xgr.Grammar.concat(head, _lit(xgr, "\n</｜DSML｜invoke>"))
    required, empty = set(params.get("required") or []), xgr.Grammar.from_ebnf('root ::= ""')
    parts = [head]
    for key, schema in props.items():
        param = _parameter(xgr, key, schema if isinstance(schema, dict) else {})
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
