"""What a new user runs, as the README and docs/ write it: bench_serving and the OpenAI client against a real server,
the launch_subprocess Engine script, the server's start-up (port in use, flags that change nothing, the chat
parsers on by default) and scripts/gpu_validate.sh's exit status. The eval scripts' failure paths run against a stub
in test_bench_clients.py; --help and CLI errors in test_cli.py."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from server_process import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
API_DOC = open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8").read()
BENCH_DOC = open(os.path.join(ROOT, "docs", "benchmarking.md"), encoding="utf-8").read()
MODEL = "tiny-deepseek-v4"


def readme_python_block(marker: str, text: str = README) -> str:
    """The ```python block of `text` (the README by default) containing `marker`."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b]
    assert len(blocks) == 1, f"expected one python block with {marker!r}, found {len(blocks)}"
    return blocks[0]


def shell_command(text: str, prefix: str) -> list:
    """The words of the command in a ```bash block of `text` that starts with `prefix` (continuation lines joined)."""
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith(prefix):
                return command.split()
    raise AssertionError(f"no command starting with {prefix!r}")


def run_script(tmp_path, code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(code)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                          cwd=str(tmp_path))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = launch(["--model-path", MODEL, "--context-length", "1024", "--trust-remote-code",
                     "--disable-cuda-graph"], str(tmp_path_factory.mktemp("server")))
    yield handle
    handle.stop()


# ---- the README's commands against a real server -----------------------------------------------------------


def test_readme_bench_serving_command(server):
    cmd = shell_command(README, "python -m sglang.bench_serving ")
    assert cmd[3:] == ["--backend", "sglang", "--num-prompts", "64", "--random-input-len", "128",
                       "--random-output-len", "32"]  # no dataset file named: random ids, offline
    proc = subprocess.run([sys.executable, *cmd[1:], "--port", server.base_url.rsplit(":", 1)[1]],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"Dataset:\s+random\n", proc.stdout) and re.search(r"Successful requests:\s+64\n", proc.stdout)
    assert "Failed requests" not in proc.stdout


def test_readme_multi_turn_command(server):
    """docs/benchmarking.md's multi-turn bench_serving run: every turn completes and later turns reuse the cached
    history."""
    cmd = shell_command(BENCH_DOC, "python -m sglang.bench_serving --backend sglang-oai-chat")
    assert "multi-turn" in cmd
    proc = subprocess.run([sys.executable, *cmd[1:], "--port", server.base_url.rsplit(":", 1)[1]],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"Successful requests:\s+12\n", proc.stdout), proc.stdout
    assert float(re.search(r"Prompt-token cache hit rate:\s+([0-9.]+)", proc.stdout).group(1)) > 0.3, proc.stdout


def test_readme_openai_client_example(server, tmp_path):
    before = README[:README.index("import openai")]
    assert "pip install openai" in before[-300:]  # said right above the example: not a dependency of sglang
    code = readme_python_block("import openai")
    assert "http://localhost:30000/v1" in code
    proc = run_script(tmp_path, code.replace("http://localhost:30000/v1", f"{server.base_url}/v1"), timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]


def test_quick_start_server_parses_tool_calls_and_reasoning(server):
    """Started with no parser flags (as the quick start shows): tool_choice "required" comes back as tool_calls and
    thinking as reasoning_content (the DeepSeek-V4 parsers are the defaults)."""
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                  "properties": {}}}}]
    msgs = [{"role": "user", "content": "What time is it?"}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="required",
                                         max_tokens=200, temperature=1.0, seed=5)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_time", choice
    think = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": True}})
    # a random model never closes </think>: everything it wrote is reasoning
    assert getattr(think.choices[0].message, "reasoning_content", None) and not think.choices[0].message.content


def test_flags_that_change_nothing_say_so(server):
    log = open(server.log_path).read()
    assert "--trust-remote-code is not needed" in log


# ---- start-up ----------------------------------------------------------------------------------------------


def test_port_in_use_fails_before_loading():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL, "--host",
                               "127.0.0.1", "--port", str(port), "--log-level", "info"],
                              capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"127.0.0.1:{port}" in out and "already in use" in out and "Traceback" not in out
    # At --log-level info a start that got further logs the applied defaults, the pools and the weights.
    for line in ("defaults applied", "server args", "Loading weights", "generating the built-in model"):
        assert line not in out


def test_every_server_arg_is_read():
    """A flag must do something: each ServerArgs field is read outside server_args.py, except the ones that
    server_args.py itself turns into the ParallelConfig (--ep, --dp, --enable-dp-attention) or the file tier's
    settings (--hicache-storage-backend-extra-config), or logs as changing nothing."""
    from sglang.srt.server_args import ServerArgs

    handled_in_server_args = {"trust_remote_code", "ep_size", "dp_size", "enable_dp_attention",
                              "hicache_storage_backend_extra_config"}
    sources = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "python", "sglang")):
        for name in files:
            if name.endswith(".py") and not (dirpath.endswith("srt") and name == "server_args.py"):
                sources.append(open(os.path.join(dirpath, name), encoding="utf-8").read())
    code = "\n".join(sources)
    for field in dataclasses.fields(ServerArgs):
        if field.name in handled_in_server_args:
            continue
        assert re.search(rf"\.{field.name}\b|[\"']{field.name}[\"']", code), f"--{field.name} is never read"


def test_inert_flags_accepted_and_logged(caplog):
    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
    from sglang.srt.server_args import ServerArgs

    caplog.set_level(logging.WARNING, logger="sglang.srt.server_args")
    resolve_server_args(ServerArgs(model_path=MODEL, device="cpu", trust_remote_code=True))
    assert "--trust-remote-code is not needed" in caplog.text
    caplog.clear()
    resolve_server_args(ServerArgs(model_path=MODEL, device="cpu"))
    assert "--trust-remote-code" not in caplog.text


def test_upstream_recipe_flags_start_and_say_what_they_do(caplog):
    """An upstream DeepSeek-V4 recipe's command line (H200 FP8 balanced, plus the low-latency ones' kernel flags)
    parses and resolves: --moe-a2a-backend puts the experts over every TP rank, --cuda-graph-max-bs-decode is
    --cuda-graph-max-bs, --flashinfer-mxfp4-moe-precision is --mxfp4-moe-precision (upstream's `default` is bf16),
    the rest is logged as inert;
    values upstream does not take either are errors naming the flag."""
    from sglang.launch_server import build_parser
    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
    from sglang.srt.server_args import ServerArgs

    recipe = ("--model-path tiny-deepseek-v4 --device cpu --tp 4 --dp 4 --enable-dp-attention --moe-a2a-backend "
              "deepep --cuda-graph-max-bs-decode 128 --max-running-requests 128 --moe-runner-backend marlin "
              "--flashinfer-mxfp4-moe-precision default --disable-flashinfer-autotune --tokenizer-worker-num 8 "
              "--enable-prefill-delayer --prefill-delayer-max-delay-ms 5000 --deepep-config {} "
              "--speculative-attention-mode decode --speculative-draft-attention-backend triton "
              "--enable-w4a4-mxfp4-megamoe").split()
    caplog.set_level(logging.WARNING, logger="sglang.srt.server_args")
    args = ServerArgs.from_cli_args(build_parser().parse_args(recipe))
    args.validate()
    assert (args.ep_size, args.cuda_graph_max_bs, args.mxfp4_moe_precision) == (4, 128, "bf16")
    args.log_inert_flags()
    assert "--moe-a2a-backend deepep: routed experts over 4 expert-parallel ranks" in caplog.text
    assert "--moe-runner-backend marlin" in caplog.text
    assert ("--deepep-config, --disable-flashinfer-autotune, --tokenizer-worker-num, --enable-prefill-delayer, "
            "--prefill-delayer-max-delay-ms, --speculative-attention-mode, --speculative-draft-attention-backend, "
            "--enable-w4a4-mxfp4-megamoe: accepted from upstream's recipes; change nothing here") in caplog.text
    caplog.clear()
    resolve_server_args(ServerArgs(model_path=MODEL, device="cpu"))
    assert "upstream" not in caplog.text
    for bad, flag in ((dict(moe_runner_backend="vllm"), "--moe-runner-backend"),
                      (dict(moe_a2a_backend="nccl"), "--moe-a2a-backend"),
                      (dict(deepep_config="{not json"), "--deepep-config"),
                      (dict(cuda_graph_max_bs=64, cuda_graph_max_bs_decode=128), "--cuda-graph-max-bs-decode"),
                      (dict(tokenizer_worker_num=0), "--tokenizer-worker-num"),
                      (dict(speculative_attention_mode="verify"), "--speculative-attention-mode")):
        with pytest.raises(ValueError, match=flag):
            ServerArgs(model_path=MODEL, device="cpu", **bad).validate()


def test_speculative_draft_model_path_names_the_served_checkpoint_or_is_refused(tmp_path, caplog):
    """The draft is always the served checkpoint's own MTP (NextN) layer: --speculative-draft-model-path naming that
    checkpoint (the same text or the same directory) is accepted and logged as changing nothing; any other path, a
    separate draft checkpoint included, is an error naming the flag (nothing else would load it)."""
    from sglang.srt.model_loader.model_path import resolve_model_path
    from sglang.srt.server_args import ServerArgs

    model_dir = resolve_model_path(MODEL)
    caplog.set_level(logging.WARNING, logger="sglang.srt.server_args")
    for model, draft in ((MODEL, MODEL), (model_dir, model_dir + "/"), (model_dir, os.path.relpath(model_dir))):
        args = ServerArgs(model_path=model, device="cpu", speculative_algorithm="EAGLE",
                          speculative_draft_model_path=draft).validate()
        args.log_inert_flags()
        assert "--speculative-draft-model-path: accepted from upstream's recipes; change nothing here" in caplog.text
        caplog.clear()
    other = tmp_path / "nextn"
    other.mkdir()
    for model, draft in ((MODEL, str(other)), (model_dir, str(other)), (model_dir, "deepseek-ai/DeepSeek-V4-Flash")):
        with pytest.raises(ValueError, match="--speculative-draft-model-path .*own MTP"):
            ServerArgs(model_path=model, device="cpu", speculative_draft_model_path=draft).validate()


def test_progress_bars_for_generation_and_loading(tmp_path, caplog, capsys):
    from sglang.srt.model_loader.loader import iter_checkpoint
    from sglang.srt.model_loader.tiny_checkpoint import TINY_CONFIG, make_tiny_checkpoint

    caplog.set_level(logging.WARNING, logger="sglang.srt.model_loader")  # --log-level warning: quiet
    make_tiny_checkpoint(str(tmp_path / "quiet"), TINY_CONFIG)
    assert "Generating" not in capsys.readouterr().err
    caplog.set_level(logging.INFO, logger="sglang.srt.model_loader")  # the server's default level
    model_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), TINY_CONFIG)
    assert re.search(r"Generating random weights: 100%.*tensor", capsys.readouterr().err)
    n = len(list(iter_checkpoint(model_dir, part="main")))
    assert re.search(rf"Loading weights \(main\): 100%.* {n}/{n} ", capsys.readouterr().err)


# ---- sglang.Engine(launch_subprocess=True) scripts ------------------------------------------------------------

# Runs first (guarded: the spawned scheduler process re-imports the script): records every subprocess scheduler
# and, at exit after the engine's own exit hook, prints whether their event loops were closed. A loop left to
# the garbage collector printed "ValueError: Invalid file descriptor: -1" at exit on some runs.
PROBE = """\
if __name__ == "__main__":
    import atexit
    from sglang.srt.entrypoints import engine_subprocess as _es

    _made, _init = [], _es.SubprocessScheduler.__init__

    def _record(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        _made.append(self)

    _es.SubprocessScheduler.__init__ = _record
    atexit.register(lambda: print("LOOPS_CLOSED", [s.loop.is_closed() for s in _made], flush=True))
"""


def test_readme_engine_scripts_exit_cleanly(tmp_path):
    """In one script (one interpreter start): the README's Offline API block as written (and the finish_reason
    shape docs/api.md describes), docs/api.md's launch_subprocess block as written, then the same block without its
    shutdown (the exit hook stops the engine and closes its loop)."""
    offline = readme_python_block('engine.generate(prompt="Hello", sampling_params={"temperature": 0, '
                                  '"max_new_tokens": 8}')
    sub = readme_python_block("launch_subprocess=True", API_DOC)
    assert 'if __name__ == "__main__":' in sub and "engine.shutdown()" in sub  # the guard the README asks for
    code = PROBE + "\n".join([
        'if __name__ == "__main__":',
        textwrap.indent(offline, "    "),
        '    print("FINISH", out["meta_info"]["finish_reason"])',
        textwrap.indent(sub, "    "),
        textwrap.indent(sub.replace("engine.shutdown()", "pass"), "    "),
    ])
    proc = run_script(tmp_path, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOOPS_CLOSED [True, True]" in proc.stdout, proc.stdout
    for noise in ("Invalid file descriptor", "Exception ignored", "Traceback", "Task was destroyed", "leaked"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"FINISH (.*)", proc.stdout).group(1) == "{'type': 'length', 'length': 8}"
    assert '`{"type": "length", "length": 8}`' in API_DOC  # the docs describe exactly this shape


# ---- scripts/gpu_validate.sh ------------------------------------------------------------------------------------


def fake_python(tmp_path, fail_on: str) -> dict:
    """PATH with a python3 that succeeds, except (exit 3) when its arguments contain `fail_on`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "python3"
    script.write_text(f'#!/bin/sh\ncase "$*" in *"{fail_on}"*) echo "fake failure"; exit 3;; esac\necho "ok $*"\n')
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}


@pytest.mark.parametrize("mode, fail_on, failed_step", [
    ("", "no step has this in its arguments", None),
    ("", "test_gpu_triton_backend.py", "triton backend tests"),  # its output is piped into tee | tail
    ("", "plot_agentic_memory.py", "plot"),  # the last step
    ("quick", "-m gpu test/kernels", "kernel tests (GPU-marked)"),
    ("tests", "test_engine_api.py", "engine suite on the triton backend"),
])
def test_gpu_validate_exit_status(tmp_path, mode, fail_on, failed_step):
    script = os.path.join(ROOT, "scripts", "gpu_validate.sh")
    assert "set -u -o pipefail" in open(os.path.join(ROOT, "scripts", "gpu_env.sh")).read()  # its shared preamble
    proc = subprocess.run(["bash", script, *([mode] if mode else [])], capture_output=True, text=True,
                          timeout=60, cwd=str(tmp_path), env=fake_python(tmp_path, fail_on))
    if failed_step is None:
        assert proc.returncode == 0 and "all steps passed" in proc.stdout, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"failed step: {failed_step}" in proc.stdout
        assert proc.stdout.count("failed step:") == 1  # the steps after it still ran and passed
