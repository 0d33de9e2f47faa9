"""The server's command line: --help in groups with a short usage line and every default stated, the argparse
defaults equal to ServerArgs', errors of one line naming the flag (exit status 2, no usage dump, no traceback), the
DeepSeek-V4 chat parsers on by default and `none` turning them off, and --mxfp4-moe-precision's values."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from sglang.launch_server import build_parser
from sglang.srt.arg_groups.deepseek_v4_hook import describe_parsers, resolve_server_args
from sglang.srt.arg_groups.upstream_recipes import add_recipe_args
from sglang.srt.server_args import ServerArgs

MODEL = "tiny-deepseek-v4"
GROUPS = ["options", "model and loading", "HTTP / API", "scheduling and memory", "hierarchical cache", "parallelism",
          "speculative decoding", "prefill/decode disaggregation", "kernels and backends", "observability",
          "accepted for upstream SGLang recipes"]


def launch_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", *argv], capture_output=True, text=True,
                          timeout=120)


def help_sections(text: str) -> dict:
    """{group title: {flag: its help block on one line}}, in --help's order; a title starts at column 0."""
    sections = {}
    for chunk in re.split(r"\n(?=\S)", text):
        title, _, body = chunk.partition("\n")
        if title.endswith(":"):
            blocks = re.split(r"\n(?=  -)", body)
            sections[title[:-1]] = {b.split()[0].rstrip(","): " ".join(b.split()) for b in blocks
                                    if b.strip().startswith("-")}
    return sections


def test_help_is_grouped_with_a_short_usage_and_every_default():
    proc = launch_cli("--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.split("\n\n", 1)[0] == "usage: python -m sglang.launch_server --model-path PATH [options]"
    sections = help_sections(text)
    assert list(sections) == GROUPS
    recipe_parser = argparse.ArgumentParser()
    add_recipe_args(recipe_parser)
    recipe_flags = {a.option_strings[0] for a in recipe_parser._actions if a.dest != "help"}
    assert set(sections["accepted for upstream SGLang recipes"]) == recipe_flags
    assert "--disable-radix-cache" in sections["scheduling and memory"]
    assert "--reasoning-parser" in sections["HTTP / API"] and "--tp" in sections["parallelism"]
    by_flag = {flag: block for section in sections.values() for flag, block in section.items()}
    actions = [a for a in build_parser()._actions if a.dest != "help"]
    assert {a.dest for a in actions} == {f.name for f in dataclasses.fields(ServerArgs)}  # one flag per field
    for action in actions:
        flag = action.option_strings[0]
        assert flag in by_flag, f"{flag} missing from --help"
        if not action.required:
            assert "default" in by_flag[flag], f"{flag}: no default in --help: {by_flag[flag]!r}"
    assert "off with --speculative-algorithm" not in by_flag["--disable-radix-cache"]  # the cache serves both


def test_flag_defaults_are_the_server_args_defaults():
    assert ServerArgs.from_cli_args(build_parser().parse_args(["--model-path", "m"])) == ServerArgs(model_path="m")


@pytest.mark.parametrize("argv, says", [
    (["--model-path", MODEL, "--foo"], "error: unrecognized arguments: --foo (python -m sglang.launch_server --help "
                                       "lists the options)"),
    (["--model-path", MODEL, "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--model-path", MODEL, "--reasoning-parser", "qwen3"], "argument --reasoning-parser: invalid choice"),
    ([], "the following arguments are required: --model-path"),
    (["--model-path", "/nonexistent/checkpoint"], "error: --model-path /nonexistent/checkpoint: no such directory"),
    (["--model-path", MODEL, "--tp", "3"], "error: --tp 3: 4 attention heads do not split over 3 ranks"),
    (["--model-path", MODEL, "--mxfp4-moe-precision", "fp8"], "error: --mxfp4-moe-precision fp8 (W4A8) is not served"),
    (["--model-path", MODEL, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/models/NextN"],
     "error: --speculative-draft-model-path '/models/NextN': the draft here is always --model-path's own MTP"),
    (["--model-path", MODEL, "--watchdog-timeout", "0"], "error: --watchdog-timeout must be a positive number"),
    (["--model-path", MODEL, "--max-queued-requests", "-1"], "error: --max-queued-requests must be 0 or more"),
    (["--model-path", MODEL, "--api-key", "k", "--admin-api-key", "k"], "error: --admin-api-key must be a non-empty "
                                                                         "key other than --api-key"),
    (["--model-path", MODEL, "--weights-dir", "/nonexistent/weights"], "error: --weights-dir /nonexistent/weights: "
                                                                       "no such directory"),
])
def test_cli_errors_are_one_line_naming_the_flag(argv, says):
    proc = launch_cli(*argv, "--port", "0", "--log-level", "warning", "--device", "cpu")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) <= 3 and says in lines[-1], proc.stderr
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr and not proc.stdout


def test_model_errors_name_the_model_path(tmp_path):
    with pytest.raises(ValueError, match=r"--model-path .*: config.json not found"):
        resolve_server_args(ServerArgs(model_path=str(tmp_path), device="cpu"))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"--model-path .*: config field 'model_type' must be 'deepseek_v4'"):
        resolve_server_args(ServerArgs(model_path=str(tmp_path), device="cpu"))


def test_mxfp4_moe_precision_values():
    """bf16 and upstream's `default` (the same W4A16 path) are served; fp8 (W4A8) is refused naming the flag."""
    for argv in (["--mxfp4-moe-precision", "bf16"], ["--flashinfer-mxfp4-moe-precision", "default"]):
        args = ServerArgs.from_cli_args(build_parser().parse_args(["--model-path", MODEL, *argv]))
        assert args.validate().mxfp4_moe_precision == "bf16"
    with pytest.raises(ValueError, match=r"--mxfp4-moe-precision fp8 \(W4A8\) is not served: the W4A16 kernels "
                                         r"measured faster at every batch; use bf16"):
        ServerArgs(model_path=MODEL, mxfp4_moe_precision="fp8").validate()
    with pytest.raises(ValueError, match="--mxfp4-moe-precision must be one of"):
        ServerArgs(model_path=MODEL, mxfp4_moe_precision="fp4").validate()


def _resolved(*flags: str) -> ServerArgs:
    """The tiny model's resolved args, served as the scripted model test_chat_glue's requests name."""
    return resolve_server_args(ServerArgs.from_cli_args(build_parser().parse_args(
        ["--model-path", MODEL, "--device", "cpu", "--served-model-name", "scripted", *flags])))


def test_chat_parsers_default_on_and_none_turns_them_off():
    """Started as the quick start shows (no parser flags), the chat endpoint splits thinking into reasoning_content
    and returns tool_calls, for tool_choice "required" too; `--reasoning-parser none --tool-call-parser none` leaves
    both in content and refuses a forced tool_choice. The start-up line says which parsers run and that they are
    defaults."""
    from test_chat_glue import CALL, TOOLS, ScriptedTokenizerManager, chat

    from sglang.srt.entrypoints.http_server import create_app

    tm = ScriptedTokenizerManager()
    tm.script = "I should call the tool.</think>Let me check." + CALL
    thinking = {"chat_template_kwargs": {"thinking": True}}
    on = _resolved()
    assert (on.reasoning_parser, on.tool_call_parser) == ("deepseek-v4", "deepseekv4")
    assert describe_parsers(on) == ("--reasoning-parser deepseek-v4 (default; --reasoning-parser none turns it off), "
                                    "--tool-call-parser deepseekv4 (default; --tool-call-parser none turns it off)")
    with TestClient(create_app(tm, on)) as client:
        for choice in ("auto", "required"):
            r = chat(client, tools=TOOLS, tool_choice=choice, **thinking).json()
            msg = r["choices"][0]["message"]
            assert msg["reasoning_content"] == "I should call the tool." and msg["content"] == "Let me check."
            assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"], r
    off = _resolved("--reasoning-parser", "none", "--tool-call-parser", "none")
    assert (off.reasoning_parser, off.tool_call_parser) == (None, None)
    assert describe_parsers(off) == "--reasoning-parser none (off), --tool-call-parser none (off)"
    explicit = _resolved("--reasoning-parser", "deepseek-v4", "--tool-call-parser", "deepseekv4")
    assert describe_parsers(explicit) == "--reasoning-parser deepseek-v4, --tool-call-parser deepseekv4"
    with TestClient(create_app(tm, off)) as client:
        r = chat(client, tools=TOOLS, **thinking).json()
        msg = r["choices"][0]["message"]
        assert msg["reasoning_content"] is None and msg["tool_calls"] is None, msg
        assert msg["content"].startswith("I should call the tool.") and "get_weather" in msg["content"]
        forced = chat(client, tools=TOOLS, tool_choice="required")
        assert forced.status_code == 400 and "--tool-call-parser" in forced.json()["message"]
