"""Held-out accuracy, MTP acceptance and tool-call / JSON answers of the trained tiny DeepSeek-V4, through the server.

    python benchmark/tiny_model/evaluate.py --checkpoint tiny-v4 [--formats bf16 fp8] [--num-questions 200]
        [--speculative 1-1-2 3-1-4] [--server-args "--device cpu"] [--out result.json]

For each format (the trainer's <checkpoint>/bf16 and <checkpoint>/fp8) a server is started on it, and:
  * benchmark/gsm8k/bench_sglang.py and benchmark/mmlu/bench_sglang.py run on the held-out files (data/) as a user
    runs them on Flash (5 shots);
  * chats that ask for one of the three tools, with tool_choice "auto" (no grammar: what the model learned) and
    "required" (through the grammar): the share answered by one call that parses (a known function, arguments a JSON
    object of its parameters) and the share with the right function and arguments;
  * chats that ask for a capital in JSON, without and with a response_format schema: the share that parses as the
    asked object and the share naming the right capital;
  * then per --speculative S-K-D (--speculative-num-steps, -eagle-topk, -num-draft-tokens) a server with the
    checkpoint's MTP layer drafting (EAGLE): the GSM8K prompts through /generate, greedy - the accuracy (the same as
    without: speculative decoding changes no greedy token) and the accept length (meta_info.spec_accept_length, the
    tokens each verification emits, averaged over the questions).
One JSON object per format in --out; a table on stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import random
import shlex
import sys
import tempfile
from typing import Optional

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import data  # noqa: E402
from bench_router import free_port, start, wait_until  # noqa: E402

SHOTS = 5
ANSWER_TOKENS = 64
CHAT_TOKENS = 96


@dataclasses.dataclass
class FormatResult:
    format: str
    gsm8k: float
    gsm8k_invalid: float
    mmlu: float
    tool_auto: tuple  # (share answered by a call that parses, share with the right function and arguments)
    tool_required: tuple
    json_plain: tuple  # (share whose answer parses as the asked object, share naming the right capital)
    json_schema: tuple
    speculative: dict = dataclasses.field(default_factory=dict)  # "S-K-D" -> {"gsm8k", "accept_length"}


class Server:
    """A launch_server process on a free port, stopped on exit."""

    def __init__(self, model_path: str, extra: list, log_dir: str, name: str, timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc, log = start("sglang.launch_server", ["--model-path", model_path, "--host", "127.0.0.1", "--port",
                                                        str(self.port), *extra], log_dir, name)
        try:
            wait_until(f"{self.url}/health", self.proc, log, timeout)
            self.model = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except Exception:
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def tool_requests(n: int) -> list:
    """(messages, function name, arguments) of n tool-asking chats, drawn from a seed the trainer never uses."""
    corpus = data.Corpus(data.HELDOUT_SEED + 1)
    out = []
    for _ in range(n):
        user, name, args, _, _ = corpus.tool_call()
        out.append(([{"role": "user", "content": user}], name, args))
    return out


def json_requests(n: int) -> list:
    rng = random.Random(data.HELDOUT_SEED + 2)
    return [rng.choice(sorted(data.COUNTRIES)) for _ in range(n)]


def chat(server: Server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": server.model, "temperature": 0, "max_tokens": CHAT_TOKENS, **body}, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]


def tool_share(server: Server, requests: list, tool_choice: str, parallel: int) -> tuple:
    """(share answered by one call that parses: a known function, arguments a JSON object of its parameters;
    share whose call is the right function with the right arguments)."""
    params = {t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in data.TOOLS}

    def one(req) -> tuple:
        messages, name, args = req
        calls = chat(server, {"messages": messages, "tools": data.TOOLS, "tool_choice": tool_choice}).get("tool_calls")
        if not calls or len(calls) != 1 or calls[0]["function"]["name"] not in params:
            return False, False
        try:
            got = json.loads(calls[0]["function"]["arguments"])
        except json.JSONDecodeError:
            return False, False
        parsed = isinstance(got, dict) and set(got) <= params[calls[0]["function"]["name"]]
        return parsed, parsed and calls[0]["function"]["name"] == name and got == args

    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        rows = list(pool.map(one, requests))
    return tuple(sum(r[i] for r in rows) / max(len(rows), 1) for i in (0, 1))


def json_share(server: Server, countries: list, schema: bool, parallel: int) -> tuple:
    """(share whose answer parses as a JSON object with the keys country and capital; share naming the right
    capital)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": {
        "type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"]}}}

    def one(country: str) -> tuple:
        if schema:
            body = {"messages": [{"role": "user", "content": f"What is the capital of {country}?"}],
                    "response_format": fmt}
        else:
            body = {"messages": [{"role": "user", "content": f"What is the capital of {country}? Answer in JSON "
                                                             f"with the keys country and capital."}]}
        try:
            got = json.loads(chat(server, body)["content"] or "")
        except json.JSONDecodeError:
            return False, False
        parsed = isinstance(got, dict) and {"country", "capital"} <= set(got)
        return parsed, parsed and got["capital"] == data.COUNTRIES[country]

    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        rows = list(pool.map(one, countries))
    return tuple(sum(r[i] for r in rows) / max(len(rows), 1) for i in (0, 1))


def speculative_gsm8k(url: str, num_questions: int, parallel: int) -> dict:
    """Greedy GSM8K-style answers through /generate: accuracy and the mean accept length over the questions."""
    lines = data.GSM8K.load_lines(data.GSM8K_TEST)
    prompts, questions = data.GSM8K.build_prompts(lines, SHOTS, num_questions)

    def one(i: int) -> tuple:
        r = httpx.post(f"{url}/generate", json={"text": prompts[i], "sampling_params": {
            "temperature": 0, "max_new_tokens": ANSWER_TOKENS, "stop": data.GSM8K.STOP}}, timeout=600)
        r.raise_for_status()
        out = r.json()
        right = data.GSM8K.same_number(data.GSM8K.extract_answer(out["text"]), data.GSM8K.label_of(
            questions[i]["answer"]))
        return right, out["meta_info"].get("spec_accept_length")

    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        rows = list(pool.map(one, range(len(prompts))))
    accepts = [a for _, a in rows if a is not None]
    if len(accepts) != len(rows):
        raise RuntimeError("the server reported no spec_accept_length: was it started with speculative decoding?")
    return {"gsm8k": sum(r for r, _ in rows) / len(rows), "accept_length": sum(accepts) / len(accepts)}


def evaluate_format(args, fmt: str, log_dir: str) -> FormatResult:
    path = os.path.join(args.checkpoint, fmt)
    common = ["--page-size", "64", "--context-length", "1024", "--max-running-requests", str(args.parallel),
              *shlex.split(args.server_args)]
    with Server(path, common, log_dir, fmt, args.startup_timeout) as server:
        port = str(server.port)
        gsm = data.GSM8K.main(["--port", port, "--data-path", data.GSM8K_TEST, "--num-shots", str(SHOTS),
                               "--num-questions", str(args.num_questions), "--max-tokens", str(ANSWER_TOKENS),
                               "--parallel", str(args.parallel)])
        mmlu = data.MMLU.main(["--port", port, "--data-dir", data.MMLU_DIR, "--ntrain", str(SHOTS),
                               "--parallel", str(args.parallel)])
        tools, countries = tool_requests(args.num_chats), json_requests(args.num_chats)
        result = FormatResult(fmt, gsm.accuracy, gsm.invalid, mmlu.accuracy,
                              tool_share(server, tools, "auto", args.parallel),
                              tool_share(server, tools, "required", args.parallel),
                              json_share(server, countries, False, args.parallel),
                              json_share(server, countries, True, args.parallel))
    for spec in args.speculative:
        steps, topk, draft = spec.split("-")
        flags = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", steps, "--speculative-eagle-topk", topk,
                 "--speculative-num-draft-tokens", draft]
        with Server(path, [*common, *flags], log_dir, f"{fmt}-{spec}", args.startup_timeout) as server:
            result.speculative[spec] = speculative_gsm8k(server.url, args.num_questions, args.parallel)
    return result


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="the trainer's --out directory (holding bf16/ and fp8/)")
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--num-questions", type=int, default=200, help="held-out GSM8K-style questions (at most 200)")
    p.add_argument("--num-chats", type=int, default=24, help="tool-call and JSON chats, each")
    p.add_argument("--speculative", nargs="*", default=["1-1-2", "3-1-4"], metavar="S-K-D")
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--server-args", default="", help="more launch_server flags, e.g. \"--device cpu\"")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--out", default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    for spec in args.speculative:
        parts = spec.split("-")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"--speculative takes S-K-D (three positive integers, e.g. 3-1-4), got {spec!r}")
    if not 1 <= args.num_questions <= data.GSM8K_HELDOUT - SHOTS:
        p.error(f"--num-questions must be in [1, {data.GSM8K_HELDOUT - SHOTS}]")
    for fmt in args.formats:
        if not os.path.isfile(os.path.join(args.checkpoint, fmt, "config.json")):
            p.error(f"{os.path.join(args.checkpoint, fmt)} holds no checkpoint (config.json): pass the trainer's --out")
    return args


def main(argv: Optional[list] = None) -> list:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as log_dir:
        results = [evaluate_format(args, fmt, log_dir) for fmt in args.formats]
    head = ("| format | GSM8K-style | invalid | MMLU-style | tool call auto: parsed, right | required: parsed, right | "
            "JSON plain: parsed, right | schema: parsed, right |")
    print(head + "".join(f" {s}: GSM8K, accept length |" for s in args.speculative))
    for r in results:
        spec = "".join(f" {r.speculative[s]['gsm8k']:.3f}, {r.speculative[s]['accept_length']:.2f} |"
                       for s in args.speculative)
        pairs = "".join(f" {a:.3f}, {b:.3f} |" for a, b in (r.tool_auto, r.tool_required, r.json_plain, r.json_schema))
        print(f"| {r.format} | {r.gsm8k:.3f} | {r.gsm8k_invalid:.3f} | {r.mmlu:.3f} |{pairs}{spec}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return results


if __name__ == "__main__":
    main()
