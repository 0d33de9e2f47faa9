"""Few-shot GSM8K accuracy against any OpenAI-compatible server (/v1/completions).

    python benchmark/gsm8k/bench_sglang.py --port 30000 --num-shots 5 --num-questions 200 --parallel 64

The first --num-shots lines of --data-path (the standard GSM8K test.jsonl, never downloaded here: fetch it with
the command printed when it is missing) are the worked examples; the questions are the lines after them. The
prediction is the last number in the completion; a completion without a number is invalid (and wrong).

Before sending, the prompts are fitted to the served context (GET /v1/models max_model_len): shots are dropped
first, then --max-tokens is shortened; a context too small for even that is refused. Any failed request makes
the script exit 1 after printing the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from typing import Callable, Optional

from sglang.utils_openai_client import (CONTEXT_MARGIN, ServerError, add_pool_args, add_server_args,
                                        complete_prompts, count_tokens, exit_if_failed, served_model, write_json)

GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl"
STOP = ["Question", "</s>", "<|im_end|>"]
MIN_ANSWER_TOKENS = 64  # shortest --max-tokens a fitted run may use: a worked answer needs room

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
    num_shots: int  # as sent (after fitting to the context)
    model: str
    records: list  # list[QuestionRecord]
    max_tokens: int = 0  # as sent
    failed: int = 0  # requests that got no completion (the script then exits 1)


def load_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise SystemExit(f"error: no GSM8K data at {path}. Fetch the standard test set with\n"
                         f"  curl -L -o {path} {GSM8K_URL}\n"
                         f"or pass --data-path to a copy of it.")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def label_of(answer: str) -> float:
    value = extract_answer(answer.split("####")[-1])
    if value is None:
        raise ValueError(f"GSM8K answer without '#### <number>': {answer[-80:]!r}")
    return value


def build_prompts(lines: list[dict], num_shots: int, num_questions: int,
                  used_shots: Optional[int] = None) -> tuple[list[str], list[dict]]:
    """The questions are the lines after the first `num_shots`; the prompts show the first `used_shots` of
    those (default all), so fitting fewer shots to the context keeps the same questions."""
    used = num_shots if used_shots is None else used_shots
    shots = "".join(f"Question: {x['question']}\nAnswer: {x['answer']}\n\n" for x in lines[:used])
    questions = lines[num_shots:num_shots + num_questions]
    return [f"{shots}Question: {x['question']}\nAnswer:" for x in questions], questions


@dataclasses.dataclass
class ContextFit:
    num_shots: int
    max_tokens: int
    notes: list  # one line per adjustment, printed before sending


def fit_to_context(longest_prompt: Callable[[int], int], num_shots: int, max_tokens: int, context_length: int,
                   margin: int = CONTEXT_MARGIN, min_answer_tokens: int = MIN_ANSWER_TOKENS) -> ContextFit:
    """Shots and max_tokens such that the longest prompt (`longest_prompt(shots)` tokens) plus max_tokens plus
    `margin` fit `context_length`: drop shots first (down to 0), then shorten max_tokens, but not below
    `min_answer_tokens` (a ValueError says what would be needed)."""
    budget = context_length - margin
    shots = num_shots
    while shots > 0 and longest_prompt(shots) + max_tokens > budget:
        shots -= 1
    notes = []
    if shots < num_shots:
        notes.append(f"--num-shots {num_shots} -> {shots}: the served context is {context_length} tokens")
    room = budget - longest_prompt(shots)
    if room >= max_tokens:
        return ContextFit(shots, max_tokens, notes)
    if room < min(min_answer_tokens, max_tokens):
        raise ValueError(f"the served context of {context_length} tokens is too small: the longest question alone "
                         f"takes {longest_prompt(shots)} tokens with {shots} shots, leaving {max(room, 0)} for the "
                         f"answer (at least {min(min_answer_tokens, max_tokens)} needed); serve a longer "
                         f"--context-length")
    notes.append(f"--max-tokens {max_tokens} -> {room}: the served context is {context_length} tokens")
    return ContextFit(shots, room, notes)


def fitted_prompts(args: argparse.Namespace, lines: list[dict],
                   context_length: Optional[int]) -> tuple[list[str], list[dict], ContextFit]:
    """The prompts and questions to send and the fit used (unchanged when the context length is unknown)."""
    if context_length is None:
        print("the server reports no context length: prompts are sent unchecked")
        prompts, questions = build_prompts(lines, args.num_shots, args.num_questions)
        return prompts, questions, ContextFit(args.num_shots, args.max_tokens, [])
    lengths: dict = {}

    def longest(shots: int) -> int:
        if shots not in lengths:
            prompts, _ = build_prompts(lines, args.num_shots, args.num_questions, shots)
            lengths[shots] = max(count_tokens(prompts), default=0)
        return lengths[shots]

    fit = fit_to_context(longest, args.num_shots, args.max_tokens, context_length)
    for note in fit.notes:
        print(note)
    prompts, questions = build_prompts(lines, args.num_shots, args.num_questions, fit.num_shots)
    return prompts, questions, fit


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(p)
    add_pool_args(p, parallel=64)
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-questions", type=int, default=200)
    p.add_argument("--data-path", default="test.jsonl", help=f"GSM8K test.jsonl (from {GSM8K_URL})")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--result-file", default=None, help="write accuracy, latency and per-question records as JSON")
    return p.parse_args(argv)


def main(argv: Optional[list] = None) -> Gsm8kResult:
    """Run the eval; exits 1 (SystemExit) when the data is missing, the server cannot be reached, the context
    cannot fit a question, or any request failed (after printing the results)."""
    args = parse_args(argv)
    lines = load_lines(args.data_path)
    try:
        served = served_model(args)
    except ServerError as e:
        raise SystemExit(f"error: {e}") from None
    args.model = args.model or served.id
    try:
        prompts, questions, fit = fitted_prompts(args, lines, args.context_length or served.context_length)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    batch = complete_prompts(args, prompts, desc="gsm8k", max_tokens=fit.max_tokens,
                             temperature=args.temperature, stop=STOP)
    records = []
    for q, out in zip(questions, batch.completions):
        label, pred = label_of(q["answer"]), extract_answer(out.text)
        records.append(QuestionRecord(q["question"], label, out.text, pred, same_number(pred, label), out.error))
    n = max(len(records), 1)
    result = Gsm8kResult(accuracy=sum(r.correct for r in records) / n,
                         invalid=sum(r.pred is None for r in records) / n, latency=batch.latency_s,
                         output_throughput=batch.output_throughput, num_questions=len(records),
                         num_shots=fit.num_shots, model=batch.model, records=records,
                         max_tokens=fit.max_tokens, failed=sum(r.error is not None for r in records))
    print(f"Accuracy: {result.accuracy:.3f}")
    print(f"Invalid: {result.invalid:.3f}")
    print(f"Latency: {result.latency:.3f} s")
    print(f"Output throughput: {result.output_throughput:.3f} token/s")
    if args.result_file:
        write_json(args.result_file, result)
    exit_if_failed([r.error for r in records])
    return result


if __name__ == "__main__":
    main()
