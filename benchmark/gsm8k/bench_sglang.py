"""Few-shot GSM8K accuracy against any OpenAI-compatible server (/v1/completions).

    python benchmark/gsm8k/bench_sglang.py --port 30000 --num-shots 5 --num-questions 200 --parallel 64

The first --num-shots lines of --data-path (the standard GSM8K test.jsonl) are the worked examples; the
questions are the lines after them. The prediction is the last number in the completion; a completion
without a number is invalid (and wrong).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import urllib.request
from typing import Optional

from sglang.utils_openai_client import add_pool_args, add_server_args, complete_prompts, write_json

GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl"
STOP = ["Question", "</s>", "<|im_end|>"]

# A sign counts only when it does not follow a word character ("10-15" ends in 15, "x = -5" in -5);
# commas must group three digits ("1,234" is one number, "1, 2" two); "$" may sit on either side of the sign.
_NUMBER = re.compile(r"(?<![\w.])([-+\u2212]?)\s?\$?\s?(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")


def extract_answer(text: str) -> Optional[float]:
    """The last number in `text`, or None when there is none."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    sign, digits = matches[-1]
    value = float(digits.replace(",", ""))
    return -value if sign in ("-", "\u2212") else value


def same_number(pred: Optional[float], label: float) -> bool:
    return pred is not None and math.isclose(pred, label, rel_tol=1e-9, abs_tol=1e-6)


@dataclasses.dataclass
class QuestionRecord:
    question: str
    label: float
    completion: str
    pred: Optional[float]
    correct: bool
    error: Optional[str] = None


@dataclasses.dataclass
class Gsm8kResult:
    accuracy: float
    invalid: float  # fraction of completions without a number
    latency: float  # seconds for the whole batch
    output_throughput: float  # completion tokens / s
    num_questions: int
    num_shots: int
    model: str
    records: list  # list[QuestionRecord]


def load_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        if os.path.basename(path) != "test.jsonl":
            raise SystemExit(f"no GSM8K file at {path}")
        path = os.path.join("/tmp", "gsm8k_test.jsonl")  # the default name: fetch the standard file once
        if not os.path.exists(path):
            print(f"downloading {GSM8K_URL} -> {path}")
            urllib.request.urlretrieve(GSM8K_URL, path)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def label_of(answer: str) -> float:
    value = extract_answer(answer.split("####")[-1])
    if value is None:
        raise ValueError(f"GSM8K answer without '#### <number>': {answer[-80:]!r}")
    return value


def build_prompts(lines: list[dict], num_shots: int, num_questions: int) -> tuple[list[str], list[dict]]:
    shots = "".join(f"Question: {x['question']}\nAnswer: {x['answer']}\n\n" for x in lines[:num_shots])
    questions = lines[num_shots:num_shots + num_questions]
    return [f"{shots}Question: {x['question']}\nAnswer:" for x in questions], questions


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(p)
    add_pool_args(p, parallel=64)
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-questions", type=int, default=200)
    p.add_argument("--data-path", default="test.jsonl",
                   help="GSM8K test.jsonl (downloaded when the default name is missing)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--result-file", default=None, help="write accuracy, latency and per-question records as JSON")
    return p.parse_args(argv)


def main(argv: Optional[list] = None) -> Gsm8kResult:
    args = parse_args(argv)
    prompts, questions = build_prompts(load_lines(args.data_path), args.num_shots, args.num_questions)
    batch = complete_prompts(args, prompts, desc="gsm8k", max_tokens=args.max_tokens,
                             temperature=args.temperature, stop=STOP)
    records = []
    for q, out in zip(questions, batch.completions):
        label, pred = label_of(q["answer"]), extract_answer(out.text)
        records.append(QuestionRecord(q["question"], label, out.text, pred, same_number(pred, label), out.error))
    n = max(len(records), 1)
    result = Gsm8kResult(accuracy=sum(r.correct for r in records) / n,
                         invalid=sum(r.pred is None for r in records) / n, latency=batch.latency_s,
                         output_throughput=batch.output_throughput, num_questions=len(records),
                         num_shots=args.num_shots, model=batch.model, records=records)
    failed = [r.error for r in records if r.error]
    if failed:
        print(f"{len(failed)} requests failed; first error: {failed[0]}")
    print(f"Accuracy: {result.accuracy:.3f}")
    print(f"Invalid: {result.invalid:.3f}")
    print(f"Latency: {result.latency:.3f} s")
    print(f"Output throughput: {result.output_throughput:.3f} token/s")
    if args.result_file:
        write_json(args.result_file, result)
    return result


if __name__ == "__main__":
    main()
