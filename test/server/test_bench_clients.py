"""Client-side tools against a stub server: bench_serving (both backends, every dataset), the GSM8K and MMLU
scripts (scoring and answer extraction), and failure handling.

The stub (aiohttp.web on a free loopback port, in a background thread) speaks the protocol our server
speaks: /v1/models, /v1/completions and /v1/chat/completions (SSE chunks, a final usage chunk with
stream_options.include_usage), native /generate (SSE chunks with the cumulative text and meta_info), and
/flush_cache. It emits " the" tokens (one DeepSeek-V4 token each, so retokenizing gives back its count) and,
for the eval scripts, looks the question up in the data the test wrote and sends the chosen reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import threading

import pytest
from aiohttp import web

from sglang import bench_serving
from sglang.utils_openai_client import load_tokenizer, server_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN, TOKEN_ID = " the", 270
EOS_AFTER = 3  # without ignore_eos the stub stops after this many tokens, with finish_reason "stop"


# ---- the stub server --------------------------------------------------------------------------------


@dataclasses.dataclass
class Stub:
    answers: dict = dataclasses.field(default_factory=dict)  # question -> reply, when the prompt contains it
    fail_every: int = 0  # the n-th, 2n-th, ... generation request (1-based) gets HTTP 500
    omit_usage: bool = False  # OpenAI responses without `usage` (the client must retokenize)
    accept_length: float = 0.0  # > 0: report spec_accept_length and stream 2 tokens per /generate chunk
    requests: int = 0
    log: list = dataclasses.field(default_factory=list)  # (path, prompt_tokens, completion_tokens) served
    inflight: int = 0
    peak_inflight: int = 0

    def reset(self) -> None:
        """Defaults and empty logs (the app is built once; tests share one Stub and reset it)."""
        for field in dataclasses.fields(self):
            fresh = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
            setattr(self, field.name, fresh)

    def reply(self, prompt, max_tokens: int, ignore_eos: bool) -> tuple[list, str]:
        if isinstance(prompt, str) and self.answers:
            question = max(self.answers, key=prompt.rfind)
            if prompt.rfind(question) >= 0:
                return [self.answers[question]], "stop"
        n = max_tokens if ignore_eos else min(max_tokens, EOS_AFTER)
        return [TOKEN] * n, "length" if n == max_tokens else "stop"

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._openai)
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/flush_cache", self._flush_cache)
        return app

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def _flush_cache(self, request):
        self.log.append(("/flush_cache", 0, 0))
        return web.Response(text="Cache flushed.")

    @web.middleware
    async def _count(self, request, handler):
        if request.path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
            return await handler(request)
        self.requests += 1
        if self.fail_every and self.requests % self.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            return await handler(request)
        finally:
            self.inflight -= 1

    async def _sse(self, request, payloads) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for payload in payloads:
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())
            await asyncio.sleep(0.0005)  # make TTFT and ITL measurable
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _openai(self, request):
        body = await request.json()
        chat = request.path.endswith("chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        pieces, finish = self.reply(prompt, body["max_tokens"], body.get("ignore_eos", False))
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(pieces), "total_tokens": n_prompt + len(pieces)}
        self.log.append((request.path, n_prompt, len(pieces)))

        def choice(text: str, done: bool, stream: bool) -> dict:
            content = ({"delta" if stream else "message": {"role": "assistant", "content": text}} if chat
                       else {"text": text})
            return {"index": 0, **content, "finish_reason": finish if done else None}

        if not body.get("stream"):
            resp = {"id": "cmpl-1", "model": body["model"], "choices": [choice("".join(pieces), True, False)]}
            return web.json_response(resp if self.omit_usage else {**resp, "usage": usage})
        chunks = [{"id": "cmpl-1", "choices": [choice(p, i == len(pieces) - 1, True)]} for i, p in enumerate(pieces)]
        if (body.get("stream_options") or {}).get("include_usage") and not self.omit_usage:
            chunks.append({"id": "cmpl-1", "choices": [], "usage": usage})
        return await self._sse(request, chunks)

    async def _generate(self, request):
        body = await request.json()
        sp = body.get("sampling_params", {})
        prompt = body.get("input_ids", body.get("text"))
        pieces, finish = self.reply(prompt, sp["max_new_tokens"], sp.get("ignore_eos", False))
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self.log.append((request.path, n_prompt, len(pieces)))

        def payload(i: int) -> dict:
            meta = {"id": "r1", "prompt_tokens": n_prompt, "completion_tokens": i, "e2e_latency": 0.01,
                    "finish_reason": {"type": finish} if i == len(pieces) else None}
            if self.accept_length:
                meta["spec_accept_length"] = self.accept_length
            return {"text": "".join(pieces[:i]), "output_ids": [TOKEN_ID] * i, "meta_info": meta}

        if not body.get("stream"):
            return web.json_response(payload(len(pieces)))
        step = 2 if self.accept_length else 1
        ends = list(range(step, len(pieces), step)) + [len(pieces)]
        return await self._sse(request, [payload(i) for i in ends])


class StubServer:
    def __init__(self) -> None:
        self.stub = Stub()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "stub server did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.stub.app(), access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    srv = StubServer()
    yield srv
    srv.stop()


@pytest.fixture
def stub(server):
    server.stub.reset()
    return server.stub


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_script(rel: str):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_")[:-3], os.path.join(ROOT, rel))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gsm8k = _load_script("benchmark/gsm8k/bench_sglang.py")
mmlu = _load_script("benchmark/mmlu/bench_sglang.py")


# ---- answer extraction ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("48 + 24 = 72\n#### 72", 72.0),
    ("The answer is $1,234.50.", 1234.5),
    ("costs -$5 after the refund", -5.0),
    ("from 10-15 people", 15.0),
    ("x = -3.25", -3.25),
    ("I have 1, 2 or 3 apples", 3.0),
    ("So 12,345,678 in total", 12345678.0),
    ("about .5 of it", 0.5),
    ("Step 2. Then 18 dollars. Done.", 18.0),
    ("a total of 7%", 7.0),
    ("no numbers here", None),
    ("", None),
])
def test_gsm8k_extract_answer(text, expected):
    assert gsm8k.extract_answer(text) == expected


def test_gsm8k_label_and_compare():
    assert gsm8k.label_of("work 1+1=2\n#### 1,000") == 1000.0
    assert gsm8k.same_number(18.0, gsm8k.label_of("#### 18")) and not gsm8k.same_number(None, 18.0)
    with pytest.raises(ValueError):
        gsm8k.label_of("no final answer")


@pytest.mark.parametrize("text, expected", [
    (" B", "B"), ("C.", "C"), ("(D) because", "D"), ("Answer: A", "A"), ("Because", None), (" ?", None), ("", None),
])
def test_mmlu_extract_choice(text, expected):
    assert mmlu.extract_choice(text) == expected


def test_server_root():
    ns = bench_serving.parse_args(["--base-url", "http://h:1/v1/"])
    assert server_root(ns) == "http://h:1"
    ns = bench_serving.parse_args(["--host", "http://10.0.0.2", "--port", "8000"])
    assert server_root(ns) == "http://10.0.0.2:8000"
    assert server_root(bench_serving.parse_args([])) == "http://127.0.0.1:30000"


# ---- GSM8K and MMLU against the stub ---------------------------------------------------------------

# (question, GSM8K answer, a correct reply in a different style each)
GSM8K_QUESTIONS = [
    ("Natalia sold clips to 48 friends, then half as many. How many?", "48/2=24, 48+24=72\n#### 72",
     "She sold 48/2 = 24 in May, so 48 + 24 = 72 in total.\n#### 72"),
    ("It is 3 degrees and drops by 8. What is it now?", "3-8=-5\n#### -5", "3 - 8 = -5. The answer is -5."),
    ("What is 2469 halved, in dollars?", "2469/2=1234.5\n#### 1234.5", "Half of 2,469 is $1,234.50."),
    ("Ten boxes of 100 dollars each. Total?", "10*100=1000\n#### 1000", "So 10 x 100 = 1,000 dollars.\n#### $1,000"),
]


def _write_gsm8k(path, num_shots: int = 5) -> None:
    with open(path, "w") as f:
        for i in range(num_shots):
            shot = {"question": f"Shot {i}: what is {i} + 1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"}
            f.write(json.dumps(shot) + "\n")
        for question, answer, _ in GSM8K_QUESTIONS:
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")


def _server_args(server) -> list:
    return ["--port", str(server.port), "--disable-tqdm"]


@pytest.mark.parametrize("mode, accuracy, invalid", [("correct", 1.0, 0.0), ("wrong", 0.0, 0.0), ("garbage", 0.0, 1.0)])
def test_gsm8k_scoring(server, stub, tmp_path, mode, accuracy, invalid):
    _write_gsm8k(tmp_path / "test.jsonl")
    for question, answer, good in GSM8K_QUESTIONS:
        wrong = f"The answer is {gsm8k.label_of(answer) + 1:g}."
        stub.answers[question] = {"correct": good, "wrong": wrong, "garbage": "I am not sure."}[mode]
    result_file = tmp_path / "gsm8k.json"
    result = gsm8k.main(["--data-path", str(tmp_path / "test.jsonl"), "--num-questions", "10",
                         "--result-file", str(result_file), *_server_args(server)])
    assert (result.accuracy, result.invalid, result.num_questions) == (accuracy, invalid, len(GSM8K_QUESTIONS))
    saved = json.loads(result_file.read_text())
    assert saved["accuracy"] == accuracy and len(saved["records"]) == len(GSM8K_QUESTIONS)
    assert saved["model"] == "stub-model" and result.output_throughput > 0
    assert len([e for e in stub.log if e[0] == "/v1/completions"]) == len(GSM8K_QUESTIONS)


def test_gsm8k_prompt_format(tmp_path):
    _write_gsm8k(tmp_path / "test.jsonl")
    lines = gsm8k.load_lines(str(tmp_path / "test.jsonl"))
    prompts, questions = gsm8k.build_prompts(lines, 5, 3)  # the questions come after the shots
    assert [q["question"] for q in questions] == [q for q, _, _ in GSM8K_QUESTIONS[:3]]
    prompts, _ = gsm8k.build_prompts(lines, 2, 1)
    assert prompts == ["Question: Shot 0: what is 0 + 1?\nAnswer: 0+1=1\n#### 1\n\n"
                       "Question: Shot 1: what is 1 + 1?\nAnswer: 1+1=2\n#### 2\n\n"
                       "Question: Shot 2: what is 2 + 1?\nAnswer:"]


MMLU_SUBJECTS = {"abstract_algebra": "BADC", "high_school_physics": "CAB"}


def _write_mmlu(root) -> dict:
    """Five dev rows and a few test rows per subject; returns question -> answer letter."""
    answers = {}
    for sub in ("dev", "test"):
        os.makedirs(root / sub, exist_ok=True)
    for subject, letters in MMLU_SUBJECTS.items():
        with open(root / "dev" / f"{subject}_dev.csv", "w") as f:
            for i in range(5):
                f.write(f'"Dev {subject} {i}, with a comma?",one,two,three,four,{"ABCD"[i % 4]}\n')
        with open(root / "test" / f"{subject}_test.csv", "w") as f:
            for i, letter in enumerate(letters):
                question = f"[{subject} q{i:02d}] Which option is right?"
                answers[question] = letter
                f.write(f"{question},w,x,y,z,{letter}\n")
    return answers


@pytest.mark.parametrize("mode, accuracy, invalid", [("correct", 1.0, 0.0), ("wrong", 0.0, 0.0), ("garbage", 0.0, 1.0)])
def test_mmlu_scoring(server, stub, tmp_path, mode, accuracy, invalid):
    answers = _write_mmlu(tmp_path)
    wrong = {"A": "B", "B": "C", "C": "D", "D": "A"}
    for question, letter in answers.items():
        stub.answers[question] = {"correct": f" {letter}", "wrong": f" {wrong[letter]}", "garbage": " ?"}[mode]
    result_file = tmp_path / "mmlu.json"
    result = mmlu.main(["--data-dir", str(tmp_path), "--result-file", str(result_file), "--parallel", "4",
                        *_server_args(server)])
    assert (result.accuracy, result.invalid, result.num_questions) == (accuracy, invalid, len(answers))
    assert result.subject_accuracy == {s: accuracy for s in MMLU_SUBJECTS}
    assert json.loads(result_file.read_text())["subject_accuracy"] == result.subject_accuracy


def test_mmlu_prompt_format(tmp_path):
    _write_mmlu(tmp_path)
    args = mmlu.parse_args(["--data-dir", str(tmp_path), "--nsub", "1", "--ntrain", "2"])
    prompts, items = mmlu.build_questions(args)
    assert len(prompts) == len(MMLU_SUBJECTS["abstract_algebra"]) and items[0][0] == "abstract_algebra"
    assert prompts[0].startswith(
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Dev abstract_algebra 0, with a comma?\nA. one\nB. two\nC. three\nD. four\nAnswer: A\n\n")
    assert prompts[0].endswith("[abstract_algebra q00] Which option is right?\nA. w\nB. x\nC. y\nD. z\nAnswer:")


def test_gsm8k_failed_requests_score_as_invalid(server, stub, tmp_path):
    _write_gsm8k(tmp_path / "test.jsonl")
    stub.fail_every = 1  # every request: HTTP 500, retried, then recorded as failed
    result = gsm8k.main(["--data-path", str(tmp_path / "test.jsonl"), "--max-retries", "1", *_server_args(server)])
    assert result.accuracy == 0.0 and result.invalid == 1.0
    assert all("HTTP 500" in r.error for r in result.records)
    assert stub.requests == 2 * len(GSM8K_QUESTIONS)  # one retry each


# ---- bench_serving against the stub ----------------------------------------------------------------

SMALL = ["--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "0.5",
         "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "24",
         "--gsp-question-len", "8", "--gsp-output-len", "5", "--sharegpt-output-len", "6"]


def _write_sharegpt(path) -> None:
    convs = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Tell me fact number {i} about the sea, in a few words please."},
        {"from": "gpt", "value": f"Fact {i}: the sea is deep and salty."}]} for i in range(12)]
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})  # one turn: skipped
    path.write_text(json.dumps(convs))


def _bench(server, tmp_path, *extra) -> tuple:
    argv = ["--port", str(server.port), "--num-prompts", "8", "--max-concurrency", "4", "--disable-tqdm",
            "--output-file", str(tmp_path / "bench.jsonl"), "--dataset-path", str(tmp_path / "sharegpt.json"),
            *SMALL, *extra]
    args = bench_serving.parse_args(argv)
    return args, bench_serving.run_benchmark(args)


def _check_metrics(r) -> None:
    for key, value in r.record().items():
        if isinstance(value, float) and key != "request_rate":
            assert math.isfinite(value) and value >= 0, key
    pairs = (("ttft", "p99"), ("tpot", "p99"), ("itl", "p99"), ("e2e_latency", "p90"), ("e2e_latency", "p99"))
    for name, tail in pairs:
        assert getattr(r, f"median_{name}_ms") <= getattr(r, f"{tail}_{name}_ms") + 1e-9, name
    assert r.p90_e2e_latency_ms <= r.p99_e2e_latency_ms and r.p99_itl_ms <= r.max_itl_ms
    assert 0 < r.mean_ttft_ms <= r.mean_e2e_latency_ms


@pytest.mark.parametrize("backend, dataset", [
    ("sglang", "random"), ("openai", "random"), ("sglang", "random-ids"), ("sglang-oai", "random-ids"),
    ("sglang", "generated-shared-prefix"), ("openai", "sharegpt"), ("openai-chat", "sharegpt"),
])
def test_bench_serving(server, stub, tmp_path, backend, dataset):
    _write_sharegpt(tmp_path / "sharegpt.json")
    args, r = _bench(server, tmp_path, "--backend", backend, "--dataset-name", dataset, "--flush-cache")
    rows = bench_serving.get_dataset(args, load_tokenizer(None))
    served = [entry for entry in stub.log if entry[0] != "/flush_cache"][args.warmup_requests:]
    assert stub.log[args.warmup_requests][0] == "/flush_cache"  # after the warmup, before the run
    assert (r.completed, r.failed, len(served)) == (len(rows), 0, len(rows))
    # ignore_eos: the stub sent exactly max_tokens each, and the client counted exactly what it sent
    assert r.total_output_tokens == sum(e[2] for e in served) == sum(row.output_len for row in rows)
    assert r.total_output_tokens_retokenized == r.total_output_tokens
    assert r.total_input_tokens == sum(e[1] for e in served)
    assert r.max_concurrent_requests <= 4 and stub.peak_inflight <= 4
    assert r.accept_length is None
    _check_metrics(r)
    record = json.loads((tmp_path / "bench.jsonl").read_text().splitlines()[-1])
    assert record["completed"] == len(rows) and record["args"]["backend"] == backend
    assert record["request_rate"] == "inf"  # strict JSON, no Infinity


def test_random_lengths_follow_range_ratio():
    tok = load_tokenizer(None)
    fixed = bench_serving.get_dataset(bench_serving.parse_args(
        ["--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "7",
         "--random-range-ratio", "1.0"]), tok)
    assert all(row.output_len == 7 and abs(row.prompt_len - 40) <= 2 for row in fixed)
    ids = bench_serving.get_dataset(bench_serving.parse_args(
        ["--dataset-name", "random-ids", "--num-prompts", "50", "--random-input-len", "20", "--random-output-len", "10",
         "--random-range-ratio", "0.5"]), tok)
    assert all(10 <= row.prompt_len == len(row.prompt) <= 20 and 5 <= row.output_len <= 10 for row in ids)
    special = set(tok.get_added_tokens_decoder())
    assert not any(i in special for row in ids for i in row.prompt)
    gsp_args = bench_serving.parse_args(["--dataset-name", "generated-shared-prefix", *SMALL])
    gsp = bench_serving.get_dataset(gsp_args, tok)
    assert len(gsp) == 6 and len({row.prompt.split("\n\n")[0] for row in gsp}) == 2


def test_bench_serving_counts_failures(server, stub, tmp_path, capsys):
    stub.fail_every = 3  # requests 3, 6, 9 of 1 warmup + 10
    _, r = _bench(server, tmp_path, "--backend", "sglang", "--dataset-name", "random", "--num-prompts", "10")
    assert (r.completed, r.failed) == (7, 3) and "HTTP 500" in r.first_error
    assert r.total_output_tokens == sum(e[2] for e in stub.log[1:])
    _check_metrics(r)
    out = capsys.readouterr().out
    assert "Failed requests:                         3" in out and "First error: ServerError: HTTP 500" in out


def test_bench_serving_server_down(tmp_path):
    argv = ["--port", str(_free_port()), "--dataset-name", "random-ids", "--num-prompts", "3", "--disable-tqdm", *SMALL]
    r = bench_serving.run_benchmark(bench_serving.parse_args([*argv, "--warmup-requests", "0"]))
    assert (r.completed, r.failed, r.total_output_tokens) == (0, 3, 0) and r.first_error
    assert all(math.isfinite(v) for k, v in r.record().items() if isinstance(v, float) and k != "request_rate")
    with pytest.raises(RuntimeError, match="warmup failed"):  # a dead server stops the run before it starts
        bench_serving.run_benchmark(bench_serving.parse_args(argv))


def test_bench_serving_eos_no_stream_no_usage(server, stub, tmp_path):
    stub.omit_usage = True  # the client falls back to retokenizing the text
    _, r = _bench(server, tmp_path, "--backend", "openai", "--dataset-name", "random", "--disable-ignore-eos",
                  "--disable-stream", "--request-rate", "200", "--random-output-len", "6",
                  "--random-range-ratio", "1.0")
    assert (r.completed, r.total_output_tokens) == (8, 8 * EOS_AFTER)
    assert all(o.finish_reason == "stop" and o.ttft == o.latency for o in r.outputs)
    assert r.mean_itl_ms == 0.0
    _check_metrics(r)


def test_bench_serving_accept_length_and_extra_body(server, stub, tmp_path, capsys):
    stub.accept_length = 1.75  # also streams 2 tokens per chunk
    _, r = _bench(server, tmp_path, "--backend", "sglang", "--dataset-name", "random", "--random-output-len", "8",
                  "--random-range-ratio", "1.0", "--extra-request-body", '{"sampling_params": {"top_p": 0.5}}')
    assert r.accept_length == 1.75 and r.total_output_tokens == 8 * 8
    assert all(len(o.itl) == 6 for o in r.outputs)  # 4 chunks of 2: ITL for the 6 tokens after the first chunk
    assert "Accept length:                           1.75" in capsys.readouterr().out


def test_bench_serving_cli(server, stub, tmp_path):
    out_file = tmp_path / "cli.jsonl"
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--dataset-name", "random",
           "--num-prompts", "4", "--port", str(server.port), "--output-file", str(out_file), "--disable-tqdm", *SMALL]
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Successful requests:                     4" in proc.stdout
    assert len(out_file.read_text().splitlines()) == 2  # appended, one record per run


def test_gsm8k_cli(server, stub, tmp_path):
    _write_gsm8k(tmp_path / "test.jsonl")
    stub.answers.update({q: good for q, _, good in GSM8K_QUESTIONS})
    cmd = [sys.executable, os.path.join(ROOT, "benchmark/gsm8k/bench_sglang.py"), "--num-shots", "5",
           "--data-path", str(tmp_path / "test.jsonl"), "--base-url", f"http://127.0.0.1:{server.port}/v1",
           "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Accuracy: 1.000" in proc.stdout and "Invalid: 0.000" in proc.stdout
