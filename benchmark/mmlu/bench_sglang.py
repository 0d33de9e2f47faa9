"""MMLU accuracy against any OpenAI-compatible server (/v1/completions), in the classic 5-shot format.

    python benchmark/mmlu/bench_sglang.py --port 30000 --data-dir data --ntrain 5 --parallel 128

--data-dir holds the standard per-subject CSVs (no header; question, A, B, C, D, answer letter):
dev/<subject>_dev.csv (the shots) and test/<subject>_test.csv (the questions). Nothing is downloaded here;
get them with

    curl -L https://people.eecs.berkeley.edu/~hendrycks/data.tar | tar -x   # makes ./data/{dev,test,val}

One token is generated at temperature 0; the prediction is the first standalone letter A-D in it. A prompt
longer than the served context (GET /v1/models max_model_len) gets fewer shots, as the original MMLU eval
does; a question too long even with none is refused before anything is sent. Any failed request makes the
script exit 1 after printing the results.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import re
from typing import Callable, Optional

from sglang.utils_openai_client import (CONTEXT_MARGIN, ServerError, add_pool_args, add_server_args,
                                        complete_prompts, count_tokens, exit_if_failed, served_model, write_json)

DATA_URL = "https://people.eecs.berkeley.edu/~hendrycks/data.tar"
CHOICES = "ABCD"
MAX_TOKENS = 1  # the answer letter
_CHOICE = re.compile(r"\b([A-D])\b")  # standalone, so "Answer" or "Because" do not read as A or B


def extract_choice(text: str) -> Optional[str]:
    m = _CHOICE.search(text)
    return m.group(1) if m else None


def read_csv(path: str) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [row for row in csv.reader(f) if row]


def list_subjects(data_dir: str) -> list[str]:
    test_dir = os.path.join(data_dir, "test")
    if not os.path.isdir(test_dir):
        raise SystemExit(f"error: no MMLU data at {test_dir}. Fetch it with\n"
                         f"  curl -L {DATA_URL} | tar -x\n"
                         f"(it unpacks to ./data/dev and ./data/test; --data-dir data is the default).")
    return sorted(name[: -len("_test.csv")] for name in os.listdir(test_dir) if name.endswith("_test.csv"))


def format_example(row: list[str], include_answer: bool) -> str:
    text = row[0] + "".join(f"\n{letter}. {choice}" for letter, choice in zip(CHOICES, row[1:5])) + "\nAnswer:"
    return f"{text} {row[5]}\n\n" if include_answer else text


def subject_header(subject: str, dev_rows: list[list[str]], ntrain: int) -> str:
    name = " ".join(subject.split("_"))
    shots = "".join(format_example(row, True) for row in dev_rows[:ntrain])
    return f"The following are multiple choice questions (with answers) about {name}.\n\n{shots}"


@dataclasses.dataclass
class QuestionRecord:
    subject: str
    question: str
    label: str
    completion: str
    pred: Optional[str]
    correct: bool
    error: Optional[str] = None


@dataclasses.dataclass
class MmluResult:
    accuracy: float  # over all questions (the classic weighted average)
    subject_accuracy: dict  # subject -> accuracy
    invalid: float  # fraction of completions without a standalone A-D
    latency: float
    output_throughput: float
    num_questions: int
    ntrain: int
    model: str
    records: list  # list[QuestionRecord]


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(p)
    add_pool_args(p, parallel=64)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--ntrain", type=int, default=5, help="shots per subject, from dev/")
    p.add_argument("--nsub", type=int, default=None, help="number of subjects (sorted by name); default all")
    p.add_argument("--result-file", default=None, help="write accuracies, latency and per-question records as JSON")
    return p.parse_args(argv)


def _fewer_shots(subject: str, dev_rows: list, ntrain: int, question: str, budget: int,
                 count: Callable[[list], list]) -> Optional[str]:
    """The prompt with the most shots below `ntrain` that fits `budget` tokens, or None."""
    for k in range(ntrain - 1, -1, -1):
        prompt = subject_header(subject, dev_rows, k) + question
        if count([prompt])[0] <= budget:
            return prompt
    return None


def build_questions(args: argparse.Namespace, budget: Optional[int] = None,
                    count: Callable[[list], list] = count_tokens) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """One prompt per test row with --ntrain shots; with a token `budget`, a prompt over it gets fewer shots, and
    one over it even with no shots raises ValueError (before anything is sent)."""
    prompts, items, fewer, too_long = [], [], 0, []
    for subject in list_subjects(args.data_dir)[: args.nsub]:
        dev_rows = read_csv(os.path.join(args.data_dir, "dev", f"{subject}_dev.csv"))
        header = subject_header(subject, dev_rows, args.ntrain)
        rows = read_csv(os.path.join(args.data_dir, "test", f"{subject}_test.csv"))
        questions = [format_example(row, False) for row in rows]
        subject_prompts = [header + q for q in questions]
        lengths = count(subject_prompts) if budget is not None else [0] * len(rows)
        for row, question, prompt, n in zip(rows, questions, subject_prompts, lengths):
            if budget is not None and n > budget:
                prompt = _fewer_shots(subject, dev_rows, args.ntrain, question, budget, count)
                if prompt is None:
                    too_long.append(f"{subject}: {row[0][:60]!r}")
                    continue
                fewer += 1
            prompts.append(prompt)
            items.append((subject, row))
    if too_long:
        raise ValueError(f"{len(too_long)} question(s) do not fit the served context even with no shots (first: "
                         f"{too_long[0]}); serve a longer --context-length")
    if fewer:
        print(f"{fewer} of {len(prompts)} prompts use fewer than --ntrain {args.ntrain} shots to fit the served "
              f"context")
    return prompts, items


def main(argv: Optional[list] = None) -> MmluResult:
    """Run the eval; exits 1 (SystemExit) when the data is missing, the server cannot be reached, a question
    cannot fit the context, or any request failed (after printing the results)."""
    args = parse_args(argv)
    list_subjects(args.data_dir)  # a missing data dir is reported before the server is contacted
    try:
        served = served_model(args)
    except ServerError as e:
        raise SystemExit(f"error: {e}") from None
    args.model = args.model or served.id
    context = args.context_length or served.context_length
    if context is None:
        print("the server reports no context length: prompts are sent unchecked")
    try:
        prompts, items = build_questions(args, None if context is None else context - CONTEXT_MARGIN - MAX_TOKENS)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    batch = complete_prompts(args, prompts, desc="mmlu", max_tokens=MAX_TOKENS, temperature=0.0)
    records = []
    for (subject, row), out in zip(items, batch.completions):
        pred = extract_choice(out.text)
        label = row[5].strip()
        records.append(QuestionRecord(subject, row[0], label, out.text, pred, pred == label, out.error))
    per_subject: dict = {}
    for r in records:
        per_subject.setdefault(r.subject, []).append(r.correct)
    subject_acc = {s: sum(c) / len(c) for s, c in per_subject.items()}
    n = max(len(records), 1)
    result = MmluResult(accuracy=sum(r.correct for r in records) / n, subject_accuracy=subject_acc,
                        invalid=sum(r.pred is None for r in records) / n, latency=batch.latency_s,
                        output_throughput=batch.output_throughput, num_questions=len(records),
                        ntrain=args.ntrain, model=batch.model, records=records)
    for subject, acc in subject_acc.items():
        print(f"Average accuracy {acc:.3f} - {subject}")
    print(f"Total latency: {result.latency:.3f} s")
    print(f"Invalid: {result.invalid:.3f}")
    print(f"Average accuracy: {result.accuracy:.3f}")
    if args.result_file:
        write_json(args.result_file, result)
    exit_if_failed([r.error for r in records])
    return result


if __name__ == "__main__":
    main()
