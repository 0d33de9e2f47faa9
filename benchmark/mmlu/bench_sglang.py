"""MMLU accuracy against any OpenAI-compatible server (/v1/completions), in the classic 5-shot format.

    python benchmark/mmlu/bench_sglang.py --port 30000 --data-dir data --ntrain 5 --parallel 128

--data-dir holds the standard per-subject CSVs (no header; question, A, B, C, D, answer letter):
dev/<subject>_dev.csv (the shots) and test/<subject>_test.csv (the questions). Get them from
https://people.eecs.berkeley.edu/~hendrycks/data.tar. One token is generated at temperature 0; the
prediction is the first standalone letter A-D in it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import re
from typing import Optional

from sglang.utils_openai_client import add_pool_args, add_server_args, complete_prompts, write_json

CHOICES = "ABCD"
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
        raise SystemExit(f"no {test_dir}: --data-dir must hold dev/ and test/ (see this file's docstring)")
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


def build_questions(args: argparse.Namespace) -> tuple[list[str], list[tuple[str, list[str]]]]:
    prompts, items = [], []
    for subject in list_subjects(args.data_dir)[: args.nsub]:
        header = subject_header(subject, read_csv(os.path.join(args.data_dir, "dev", f"{subject}_dev.csv")),
                                args.ntrain)
        for row in read_csv(os.path.join(args.data_dir, "test", f"{subject}_test.csv")):
            prompts.append(header + format_example(row, False))
            items.append((subject, row))
    return prompts, items


def main(argv: Optional[list] = None) -> MmluResult:
    args = parse_args(argv)
    prompts, items = build_questions(args)
    batch = complete_prompts(args, prompts, desc="mmlu", max_tokens=1, temperature=0.0)
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
    failed = [r.error for r in records if r.error]
    if failed:
        print(f"{len(failed)} requests failed; first error: {failed[0]}")
    print(f"Total latency: {result.latency:.3f} s")
    print(f"Invalid: {result.invalid:.3f}")
    print(f"Average accuracy: {result.accuracy:.3f}")
    if args.result_file:
        write_json(args.result_file, result)
    return result


if __name__ == "__main__":
    main()
