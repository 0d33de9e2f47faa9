"""DeepSeek-V4 chat prompt encoder (clean-room, per shared/docs/dsv4-encoding.md rules R1-R11).

`encode_messages` turns OpenAI-style messages into the exact prompt text (BOS included); tokenize it once with
added-token matching and without adding special tokens. `resolve_thinking` maps request fields to (thinking,
reasoning_effort). Deliberate deviations from the reference encoder are marked "deviation".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.environ import envs

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
LATEST_REMINDER = "<｜latest_reminder｜>"
DSML = "｜DSML｜"
TASK_TOKENS = {name: f"<｜{name}｜>" for name in ("action", "query", "authority", "domain", "title", "read_url")}
ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")
VARIANTS = ("preview", "0731")

TOOLS_BLOCK = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, "
    "arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{S}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
RESPONSE_FORMAT_HEADER = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
EFFORT_BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
# R10: encoder value -> preamble, per variant (0731 shifted the tiers down one: its `high` is preview's `max`).
EFFORT_PREAMBLES = {
    "preview": {None: "", "high": "", "max": EFFORT_MAX},
    "0731": {None: "", "low": "", "high": EFFORT_MAX, "max": EFFORT_BEYOND_MAX},
}
# API reasoning_effort values -> tier; "none" is handled separately (chat mode).
_API_EFFORT_TIERS = {"minimal": "low", "low": "low", "medium": "low", "high": "high", "max": "max"}


def _dumps(value: Any) -> str:
    """R8: the one JSON style used in prompts (non-ASCII kept, default separators, insertion order)."""
    return json.dumps(value, ensure_ascii=False)


def content_text(content: Any, where: str) -> str:
    """R2 content normalisation: str as is, None -> "", list parts -> text parts joined by a blank line."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"{where}: content parts must be objects with a string 'type', got {part!r}")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}: a text content part needs a string 'text'")
                parts.append(part["text"])
            else:
                parts.append(f"[Unsupported {part['type']}]")
        return "\n\n".join(parts)
    raise ValueError(f"{where}: content must be a string, a list of parts or null, got {type(content).__name__}")


def _function_of(tool: Any, where: str) -> dict:
    """The `function` object of an OpenAI tool (a bare function object is accepted too)."""
    if not isinstance(tool, dict):
        raise ValueError(f"{where}: each tool must be an object, got {type(tool).__name__}")
    if "function" in tool:
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}: unsupported tool type {tool.get('type')!r} (only 'function')")
        fn = tool["function"]
    else:
        fn = tool
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: a tool needs a function object with a non-empty string 'name'")
    return fn


def tools_block(tools: list) -> str:
    """R9: the tools section; each function object on its own line."""
    schemas = "\n".join(_dumps(_function_of(t, "tools")) for t in tools)
    return TOOLS_BLOCK.replace("{S}", schemas)


def _response_format_schema(response_format: Any) -> Any | None:
    """Schema to print for a response_format: OpenAI json_schema -> its schema; text/json_object -> nothing
    (constraining is the server's job); any other object is taken as the schema itself (the reference's form)."""
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind in ("text", "json_object"):
        return None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format of type json_schema needs json_schema.schema (an object)")
        return spec["schema"]
    return response_format


def _render_invoke(call: Any, where: str) -> str:
    if not isinstance(call, dict):
        raise ValueError(f"{where}: each tool call must be an object")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: a tool call needs function.name (a non-empty string)")
    args = fn.get("arguments")
    if args is None:
        args = {}
    elif isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        # R7: unparsable (or non-object) arguments travel as one raw string parameter.
        args = parsed if isinstance(parsed, dict) else {"arguments": args}
    elif not isinstance(args, dict):  # deviation: a dict is taken as already parsed (not nested under "arguments")
        raise ValueError(f"{where}: function.arguments must be a JSON string or an object")
    params = []
    for key, value in args.items():
        if isinstance(value, str):
            params.append(f'<{DSML}parameter name="{key}" string="true">{value}</{DSML}parameter>')
        else:
            try:
                text = _dumps(value)
            except (TypeError, ValueError) as e:  # a dict given from Python holding a set, NaN, ...
                raise ValueError(f"{where}: argument {key!r} is not JSON ({e})") from None
            params.append(f'<{DSML}parameter name="{key}" string="false">{text}</{DSML}parameter>')
    return f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>"


def render_tool_calls(tool_calls: list | None, where: str = "tool_calls") -> str:
    """R7: DSML block for an assistant's historical tool calls ("" when there are none)."""
    if not tool_calls:
        return ""
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}: tool_calls must be a list")
    invokes = "\n".join(_render_invoke(c, where) for c in tool_calls)
    return f"\n\n<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>"


@dataclass
class _Msg:
    """One message after validation and R2 merging (tool results become user turns)."""
    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)
    tools: list = field(default_factory=list)
    response_format: Any = None
    task: str | None = None
    prefix: bool = False  # assistant prefill: no EOS (R5 wo_eos)
    # R2 blocks of a user turn, in message order: (None, user text) or (rank, "<tool_result>..</tool_result>")
    blocks: list = field(default_factory=list)

    def user_text(self) -> str:
        """The turn's blocks joined by a blank line; tool results re-sorted by rank among their own slots
        (stable: equal ranks keep their order), user text blocks stay where they are."""
        ranks = sorted((b for b in self.blocks if b[0] is not None), key=lambda b: b[0])
        results = iter(ranks)
        return "\n\n".join(next(results)[1] if rank is not None else text for rank, text in self.blocks)


def _normalize(messages: list) -> list[_Msg]:
    """Validate every message and apply R2 (tool results and consecutive user messages merge into one turn)."""
    out: list[_Msg] = []
    last_calls: list = []  # ids of the latest assistant's tool calls, for re-sorting results
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: a message must be an object, got {type(raw).__name__}")
        role = raw.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        text = content_text(raw.get("content"), where)
        if raw.get("tools") and role not in ("system", "developer"):
            raise ValueError(f"{where}: tools may only be attached to a system or developer message")
        task = raw.get("task")
        if task is not None and (role != "user" or not isinstance(task, str) or task not in TASK_TOKENS):
            raise ValueError(f"{where}: task must be one of {', '.join(TASK_TOKENS)} on a user message, got {task!r}")
        if raw.get("prefix") and (role != "assistant" or i != len(messages) - 1):
            raise ValueError(f"{where}: prefix is only allowed on a final assistant message")
        if role == "tool":
            call_id = raw.get("tool_call_id")
            rank = last_calls.index(call_id) if call_id is not None and call_id in last_calls else 0  # unknown: 0
            block = (rank, f"<tool_result>{text}</tool_result>")
            if out and out[-1].role == "user":  # R2: joins the user turn before it (as the reference does)
                out[-1].blocks.append(block)
            else:
                out.append(_Msg(role="user", blocks=[block]))
            continue
        if role == "user" and out and out[-1].role == "user" and out[-1].task is None:
            out[-1].blocks.append((None, text))  # R2: consecutive user messages make one turn
            out[-1].task = task  # deviation: the reference drops a merged message's task
            continue
        msg = _Msg(role=role, content=text, task=task, prefix=bool(raw.get("prefix")),
                   blocks=[(None, text)] if role == "user" else [])
        if role in ("system", "developer"):
            tools = raw.get("tools") or []
            if not isinstance(tools, list):
                raise ValueError(f"{where}: tools must be a list")
            for t in tools:
                _function_of(t, f"{where}.tools")
            msg.tools = tools
            msg.response_format = raw.get("response_format")
            if role == "developer" and not text:
                raise ValueError(f"{where}: a developer message needs non-empty content")
        elif role == "assistant":
            reasoning = raw.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}: reasoning_content must be a string")
            msg.reasoning = reasoning or ""
            render_tool_calls(raw.get("tool_calls"), f"{where}.tool_calls")  # validate early, with the index
            msg.tool_calls = raw.get("tool_calls") or []
            if msg.tool_calls:  # as the reference: an assistant turn without calls keeps the results' order
                last_calls = [c.get("id") for c in msg.tool_calls]
        out.append(msg)
    return out


def _extras(msg: _Msg) -> str:
    """R5: the tools block and response-format section of a system/developer message."""
    text = "\n\n" + tools_block(msg.tools) if msg.tools else ""
    if msg.response_format is not None:
        schema = _response_format_schema(msg.response_format)
        if schema is not None:
            text += RESPONSE_FORMAT_HEADER + _dumps(schema)
    return text


def _attach_request_fields(messages: list, tools: list | None, response_format: dict | None) -> list:
    """R1 (as vLLM does): request-level tools go on messages[0] if it is system/developer, else on a new system
    message at index 0. The caller's list is not modified."""
    if not tools and response_format is None:
        return messages
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list")
    extra = {}
    if tools:
        extra["tools"] = tools
    if response_format is not None:
        extra["response_format"] = response_format
    first = messages[0]
    if isinstance(first, dict) and first.get("role") in ("system", "developer"):
        clash = [k for k in extra if first.get(k)]
        if clash:
            raise ValueError(f"{', '.join(clash)} given both in the request and in messages[0]")
        return [{**first, **extra}] + list(messages[1:])
    return [{"role": "system", "content": "", **extra}] + list(messages)


def encode_messages(messages: list[dict], tools: list[dict] | None = None, thinking: bool = False,
                    reasoning_effort: str | None = None, response_format: dict | None = None,
                    drop_thinking: bool = True, variant: str = "preview") -> str:
    """Render a DeepSeek-V4 prompt (BOS included). It ends with `<｜Assistant｜><think>` in thinking mode and
    `<｜Assistant｜></think>` in chat mode when the last message is a user/developer turn.

    Message fields read: role, content (str | None | list of parts), reasoning_content and tool_calls
    (assistant), tool_call_id (tool), tools and response_format (system/developer), task (user), prefix (a final
    assistant message rendered without EOS, for prefill). Request-level `tools`/`response_format` are attached
    to messages[0] if it is system/developer, else to a new system message at index 0 (ValueError if
    messages[0] already has them). response_format: json_schema -> its schema is printed; text/json_object ->
    nothing; any other object is printed as the schema. A tool message needs no preceding tool call (unknown
    ids sort first, R2); a user message with a `task` gets the task suffix where R6 would put the assistant
    prefix. reasoning_effort is the encoder value of R10 (preview: None/high/max; 0731: None/low/high/max), checked
    even in chat mode; map API values with `resolve_thinking`. Raises ValueError naming the offending message.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (expected one of {', '.join(VARIANTS)})")
    table = EFFORT_PREAMBLES[variant]
    if reasoning_effort not in table:
        allowed = ", ".join(repr(k) for k in table)
        raise ValueError(f"unknown reasoning_effort {reasoning_effort!r} for variant {variant} (expected {allowed})")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    msgs = _normalize(_attach_request_fields(messages, tools, response_format))

    # R4: drop old reasoning (and old developer turns) only in thinking mode and only without tools.
    eff_drop = drop_thinking and not any(m.tools for m in msgs)
    if thinking and eff_drop:
        last = _last_user_index(msgs)
        msgs = [m for i, m in enumerate(msgs) if not (m.role == "developer" and i < last)]
    last = _last_user_index(msgs)

    out = [BOS, table[reasoning_effort] if thinking else ""]
    for i, m in enumerate(msgs):
        nxt = msgs[i + 1] if i + 1 < len(msgs) else None
        if m.role == "system":
            out.append(m.content + _extras(m))
        elif m.role in ("user", "developer"):
            out.append(USER + (m.content + _extras(m) if m.role == "developer" else m.user_text()))
            # R6/R11: a generation point follows a user turn that is last or precedes an assistant/reminder.
            if nxt is None or nxt.role in ("assistant", "latest_reminder"):
                think_here = thinking and (not eff_drop or i >= last)
                opener = ASSISTANT + (THINK_OPEN if think_here else THINK_CLOSE)
                if m.task is None:
                    out.append(opener)
                elif m.task == "action":  # R11: <think> in thinking mode, also on a turn whose reasoning R4 drops
                    out.append(ASSISTANT + (THINK_OPEN if thinking else THINK_CLOSE) + TASK_TOKENS["action"])
                else:
                    out.append(TASK_TOKENS[m.task])
        elif m.role == "latest_reminder":
            out.append(LATEST_REMINDER + m.content)
        else:  # assistant
            after_task = i > 0 and msgs[i - 1].task is not None
            keep_think = thinking and not after_task and (not eff_drop or i > last)
            out.append((m.reasoning + THINK_CLOSE if keep_think else "") + m.content
                       + render_tool_calls(m.tool_calls) + ("" if m.prefix else EOS))
    return "".join(out)


def _last_user_index(msgs: list[_Msg]) -> int:
    return max((i for i, m in enumerate(msgs) if m.role in ("user", "developer")), default=-1)


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError(f"chat_template_kwargs.{name} must be a boolean, got {value!r}")


def resolve_thinking(chat_template_kwargs: dict | None, reasoning_effort: str | None,
                     variant: str = "preview") -> tuple[bool, str | None]:
    """Decide (thinking, encoder reasoning_effort) for a chat request.

    thinking: `chat_template_kwargs["thinking"]`, else `chat_template_kwargs["enable_thinking"]`, else
    SGLANG_DEFAULT_THINKING (off by default, like upstream SGLang). A request `reasoning_effort="none"` forces
    chat mode; any other effort does not turn thinking on by itself.
    effort (thinking mode only; chat mode returns None): the request value, else SGLANG_DSV4_REASONING_EFFORT,
    else None (the encoder's default tier). API values map to tiers minimal/low/medium -> low, high -> high,
    max -> max; then per variant: preview low -> None (preview has no low tier; None and high add nothing),
    0731 keeps low/high/max. Any other value raises ValueError (a 400 for the server).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (expected one of {', '.join(VARIANTS)})")
    kwargs = chat_template_kwargs or {}
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    if kwargs.get("thinking") is not None:
        thinking = _as_bool(kwargs["thinking"], "thinking")
    elif kwargs.get("enable_thinking") is not None:
        thinking = _as_bool(kwargs["enable_thinking"], "enable_thinking")
    else:
        thinking = envs.SGLANG_DEFAULT_THINKING.get()

    source, effort = "reasoning_effort", reasoning_effort
    if effort is None and envs.SGLANG_DSV4_REASONING_EFFORT.get():
        source, effort = "SGLANG_DSV4_REASONING_EFFORT", envs.SGLANG_DSV4_REASONING_EFFORT.get()
    if effort is not None:
        if not isinstance(effort, str):
            raise ValueError(f"{source} must be a string, got {effort!r}")
        effort = effort.strip().lower()
        if effort == "none" and source == "reasoning_effort":
            return False, None
        if effort not in _API_EFFORT_TIERS:
            allowed = ("none, " if source == "reasoning_effort" else "") + ", ".join(_API_EFFORT_TIERS)
            raise ValueError(f"unknown {source} {effort!r} (expected one of {allowed})")
    if not thinking:
        return False, None
    tier = _API_EFFORT_TIERS[effort] if effort is not None else None
    if variant == "preview" and tier == "low":
        tier = None
    return True, tier
