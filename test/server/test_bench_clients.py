"""Client-side tools against a stub server (stub_server.py): bench_serving (both backends, every dataset), the
GSM8K and MMLU scripts (scoring, answer extraction, fitting prompts to the served context), and failure
handling (failed requests, a missing data file, an unreachable server: each exits non-zero with a message).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from sglang import bench_serving
from sglang.utils_openai_client import CONTEXT_MARGIN, count_tokens, load_tokenizer, server_root
from server_process import free_port
from stub_server import EOS_AFTER, StubServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def server():
    srv = StubServer()
    yield srv
    srv.stop()


@pytest.fixture
def stub(server):
    server.stub.reset()
    return server.stub


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


def test_gsm8k_failed_requests_exit_nonzero(server, stub, tmp_path, capsys):
    _write_gsm8k(tmp_path / "test.jsonl")
    stub.fail_every = 1  # every request: HTTP 500, retried, then recorded as failed
    with pytest.raises(SystemExit) as exc:
        gsm8k.main(["--data-path", str(tmp_path / "test.jsonl"), "--max-retries", "1",
                    "--result-file", str(tmp_path / "r.json"), *_server_args(server)])
    n = len(GSM8K_QUESTIONS)
    assert f"{n} of {n} requests failed" in str(exc.value.code) and "HTTP 500" in str(exc.value.code)
    assert "Accuracy: 0.000" in capsys.readouterr().out  # printed, then the run is declared invalid
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["failed"] == n and all("HTTP 500" in r["error"] for r in saved["records"])
    assert stub.requests == 2 * n  # one retry each


def test_eval_scripts_one_failure_is_enough(server, stub, tmp_path):
    _write_gsm8k(tmp_path / "test.jsonl")
    stub.answers.update({q: good for q, _, good in GSM8K_QUESTIONS})
    stub.fail_every = 2  # requests 2 and 4 fail (no retries): the others answer correctly
    with pytest.raises(SystemExit, match="2 of 4 requests failed"):
        gsm8k.main(["--data-path", str(tmp_path / "test.jsonl"), "--max-retries", "0", "--parallel", "1",
                    *_server_args(server)])
    stub.reset()
    _write_mmlu(tmp_path)
    stub.fail_every = 5
    with pytest.raises(SystemExit, match="1 of 7 requests failed"):  # 7 MMLU questions, the 5th fails
        mmlu.main(["--data-dir", str(tmp_path), "--max-retries", "0", "--parallel", "1", *_server_args(server)])


def test_eval_scripts_missing_data(tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark/gsm8k/bench_sglang.py"),
                           "--data-path", str(missing), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"no GSM8K data at {missing}" in proc.stderr and f"curl -L -o {missing} {gsm8k.GSM8K_URL}" in proc.stderr
    assert not missing.exists()  # nothing downloaded
    with pytest.raises(SystemExit, match=r"(?s)no MMLU data at .*nope/test.*curl -L https://people\.eecs\.berkeley"):
        mmlu.main(["--data-dir", str(tmp_path / "nope"), "--port", str(free_port())])


def test_eval_scripts_server_unreachable(tmp_path):
    _write_gsm8k(tmp_path / "test.jsonl")
    port = free_port()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark/gsm8k/bench_sglang.py"), "--data-path",
                           str(tmp_path / "test.jsonl"), "--port", str(port)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "Accuracy" not in proc.stdout
    assert f"cannot query the server at http://127.0.0.1:{port}/v1/models" in proc.stderr
    _write_mmlu(tmp_path)
    with pytest.raises(SystemExit, match=f"cannot query the server at http://127.0.0.1:{port}"):
        mmlu.main(["--data-dir", str(tmp_path), "--port", str(port)])


# ---- fitting the prompts to the served context ----------------------------------------------------


def test_gsm8k_fit_to_context():
    def longest(shots):  # a 100-token question plus 150 tokens per shot
        return 100 + 150 * shots

    fit = gsm8k.fit_to_context(longest, 5, 256, context_length=4096, margin=16)
    assert (fit.num_shots, fit.max_tokens, fit.notes) == (5, 256, [])  # fits: unchanged
    fit = gsm8k.fit_to_context(longest, 5, 256, context_length=1024, margin=16)
    assert (fit.num_shots, fit.max_tokens) == (4, 256) and 100 + 150 * 4 + 256 + 16 <= 1024
    assert fit.notes == ["--num-shots 5 -> 4: the served context is 1024 tokens"]
    fit = gsm8k.fit_to_context(longest, 5, 256, context_length=300, margin=16)  # no shot; a shorter answer
    assert (fit.num_shots, fit.max_tokens) == (0, 300 - 16 - 100) and len(fit.notes) == 2
    with pytest.raises(ValueError, match="context of 150 tokens is too small.*100 tokens with 0 shots"):
        gsm8k.fit_to_context(longest, 5, 256, context_length=150, margin=16)
    fit = gsm8k.fit_to_context(longest, 2, 16, context_length=150, margin=16)  # a short answer asked: kept
    assert (fit.num_shots, fit.max_tokens) == (0, 16)


def test_gsm8k_fits_the_served_context(server, stub, tmp_path, capsys):
    _write_gsm8k(tmp_path / "test.jsonl")
    lines = gsm8k.load_lines(str(tmp_path / "test.jsonl"))
    prompts = {k: gsm8k.build_prompts(lines, 5, 10, k)[0] for k in (2, 3)}
    longest = {k: max(count_tokens(p)) for k, p in prompts.items()}
    # room for 2 shots (not 3) and --max-tokens 64, with the client's margin
    stub.context_length = longest[2] + 64 + CONTEXT_MARGIN
    assert longest[3] + 64 + CONTEXT_MARGIN > stub.context_length
    result = gsm8k.main(["--data-path", str(tmp_path / "test.jsonl"), "--max-tokens", "64", *_server_args(server)])
    assert (result.num_shots, result.max_tokens, result.num_questions) == (2, 64, len(GSM8K_QUESTIONS))
    assert "--num-shots 5 -> 2" in capsys.readouterr().out
    assert sorted(b["prompt"] for b in stub.bodies) == sorted(prompts[2][:len(GSM8K_QUESTIONS)])
    assert all(b["max_tokens"] == 64 for b in stub.bodies)
    stub.reset()
    stub.context_length = 40  # not even a question fits: refused before sending anything
    with pytest.raises(SystemExit, match="context of 40 tokens is too small"):
        gsm8k.main(["--data-path", str(tmp_path / "test.jsonl"), *_server_args(server)])
    assert stub.requests == 0
    stub.reset()  # an explicit --context-length overrides the server's
    result = gsm8k.main(["--data-path", str(tmp_path / "test.jsonl"), "--max-tokens", "64", "--context-length",
                         str(longest[3] + 64 + CONTEXT_MARGIN), *_server_args(server)])
    assert result.num_shots == 3


def test_mmlu_fits_the_served_context(server, stub, tmp_path, capsys):
    _write_mmlu(tmp_path)
    long_question = "[abstract_algebra q99] " + "very " * 60 + "long?"
    with open(tmp_path / "test" / "abstract_algebra_test.csv", "a") as f:
        f.write(f"{long_question},w,x,y,z,A\n")
    args = mmlu.parse_args(["--data-dir", str(tmp_path)])
    full, _ = mmlu.build_questions(args)
    lengths = count_tokens(full)
    budget = sorted(lengths)[-2]  # every prompt fits but the long one, which needs fewer shots
    prompts, items = mmlu.build_questions(args, budget)
    assert len(prompts) == len(full) and all(n <= budget for n in count_tokens(prompts))
    changed = [p for p, f in zip(prompts, full) if p != f]
    assert len(changed) == 1 and long_question in changed[0] and changed[0].count("\nAnswer: ") < 5
    assert "1 of 8 prompts use fewer than --ntrain 5 shots" in capsys.readouterr().out
    with pytest.raises(ValueError, match="1 question.* do not fit.*even with no shots"):
        mmlu.build_questions(args, count_tokens([mmlu.subject_header("abstract_algebra", [], 0)
                                                 + mmlu.format_example([long_question] + list("wxyz"), False)])[0] - 1)
    stub.context_length = budget + mmlu.MAX_TOKENS + CONTEXT_MARGIN  # the same through main()
    stub.answers.update({long_question: " A"})
    result = mmlu.main(["--data-dir", str(tmp_path), *_server_args(server)])
    assert result.num_questions == len(full)
    assert sorted(b["prompt"] for b in stub.bodies) == sorted(prompts)


# ---- bench_serving against the stub ----------------------------------------------------------------

SMALL = ["--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "0.5",
         "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "24",
         "--gsp-question-len", "8", "--gsp-output-len", "5", "--sharegpt-output-len", "6",
         "--mt-num-sessions", "3", "--mt-turns", "3", "--mt-first-len", "20", "--mt-turn-len", "6",
         "--mt-output-len", "4"]


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
    ("sglang", "multi-turn"), ("openai-chat", "multi-turn"),
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
    assert r.total_cached_tokens == sum(o.cached_tokens for o in r.outputs)
    if dataset == "multi-turn":  # every later turn resends the conversation: the stub reports it as cached
        assert r.total_cached_tokens > 0 and 0 < r.cache_hit_rate < 1
        assert r.total_input_tokens > sum(row.prompt_len for row in rows)  # history counted, not just new text


def test_multi_turn_sends_each_turn_after_the_previous_answer(server, stub, tmp_path):
    """Turn t of a session is the conversation so far: turn t-1 as sent, its answer, then the new message."""
    args, r = _bench(server, tmp_path, "--backend", "openai-chat", "--dataset-name", "multi-turn",
                     "--warmup-requests", "0")
    rows = bench_serving.get_dataset(args, load_tokenizer(None))
    assert r.completed == len(rows) == 9 and {row.session for row in rows} == {0, 1, 2}
    by_first = {}
    for body in stub.bodies:
        by_first.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    assert len(by_first) == 3
    for turns in by_first.values():
        assert [len(m) for m in sorted(turns, key=len)] == [1, 3, 5]
        first, second, third = sorted(turns, key=len)
        assert second[:1] == first and third[:3] == second and second[1]["role"] == "assistant"


def test_default_dataset_needs_no_file(tmp_path):
    assert bench_serving.parse_args([]).dataset_name == "random"  # offline: random ids from the tokenizer
    assert bench_serving.parse_args(["--dataset-path", "x.json"]).dataset_name == "sharegpt"
    args = bench_serving.parse_args(["--num-prompts", "3", *SMALL])
    rows = bench_serving.get_dataset(args, load_tokenizer(None))
    assert len(rows) == 3 and all(isinstance(r.prompt, str) and r.prompt_len > 0 for r in rows)
    with pytest.raises(SystemExit, match="needs --dataset-path"):  # asked for by name: still needs its file
        bench_serving.get_dataset(bench_serving.parse_args(["--dataset-name", "sharegpt"]), load_tokenizer(None))


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
    stub.reset()
    stub.fail_every = 3
    argv = ["--port", str(server.port), "--num-prompts", "10", "--max-concurrency", "4", "--disable-tqdm",
            "--backend", "sglang", "--dataset-name", "random", *SMALL]
    with pytest.raises(SystemExit, match=r"error: 3 of 10 requests failed \(first error: ServerError: HTTP 500"):
        bench_serving.main(argv)  # the command line exits 1 (a str SystemExit) when any request failed


def test_bench_serving_server_down(tmp_path):
    argv = ["--port", str(free_port()), "--dataset-name", "random-ids", "--num-prompts", "3", "--disable-tqdm", *SMALL]
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
