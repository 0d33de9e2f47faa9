"""Synthetic training and held-out data for the tiny DeepSeek-V4 (benchmark/tiny_model/train.py).

Four kinds of text, all deterministic from a seed:
  * GSM8K-style word problems (small numbers, four templates: add, take away, multiply, add a product), a worked
    answer and `#### N`, in the few-shot completion form benchmark/gsm8k/bench_sglang.py sends and as chats
    (chat mode: the worked answer; thinking mode: the work as reasoning, the number as the answer);
  * MMLU-style multiple choice (A-D) over a closed world of invented facts (capitals of invented countries, the
    colour and food of invented animals), in the few-shot form benchmark/mmlu/bench_sglang.py sends, plus plain
    statements of every fact;
  * chats that answer in JSON (with and without a response_format schema);
  * DSML tool calls for three functions, and the answer after a tool result;
  * arithmetic drills: lines of the sums, differences and products the word problems' worked answers use
    ("18 + 27 = 45"), many to a document, so that the model meets each fact far more often than one word problem
    of ~80 tokens would show it (a word problem holds one or two facts; a drill line is ~7 tokens).
Chats are rendered by the engine's own DeepSeek-V4 encoder and completion prompts by the benchmark scripts' own
prompt builders, so the model learns exactly the text the server sends. The held-out files (data/ beside this file)
come from a fixed seed; training text never contains a held-out question.

    python benchmark/tiny_model/data.py --write     # rewrite the held-out files
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import io
import json
import os
import random
import sys
from typing import Optional

from sglang.srt.entrypoints.openai.encoding_dsv4 import encode_messages

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DATA_DIR = os.path.join(HERE, "data")
GSM8K_TEST = os.path.join(DATA_DIR, "gsm8k_test.jsonl")
MMLU_DIR = os.path.join(DATA_DIR, "mmlu")
HELDOUT_SEED = 20240
GSM8K_HELDOUT = 205  # 5 worked examples (the shots) + 200 questions
MMLU_DEV = 5  # shots per subject

NAMES = ("Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena")
ITEMS = ("apples", "pens", "books", "cards", "shells", "marbles", "cookies", "coins", "stamps", "beads")
# The closed world the multiple-choice questions ask about: invented names, so no fact leaks from anywhere else.
COUNTRIES = {
    "Zorvia": "Plimton", "Quenland": "Harrowmere", "Ostrava Minor": "Velk", "Dunmarrow": "Kestrel Bay",
    "Ilyria": "Sunhold", "Brackenfeld": "Tollis", "Marvassa": "Corvin", "Nettleby": "Ashgrove",
    "Pellucida": "Riverend", "Vostmark": "Gallowfen", "Yarrowdale": "Brindle", "Calderon": "Mistport",
    "Fenwick Isles": "Saltcombe", "Glimmerholt": "Oakhaven", "Thessaly Nova": "Dawnford", "Umberlight": "Frostgate",
}
ANIMALS = {  # animal -> (colour, food)
    "glimmerfox": ("silver", "berries"), "dunehopper": ("yellow", "seeds"), "marshling": ("green", "reeds"),
    "cragbeak": ("grey", "fish"), "emberwing": ("red", "beetles"), "frostmole": ("white", "roots"),
    "velvetback": ("purple", "moss"), "tidecrawler": ("blue", "kelp"), "sunstrider": ("orange", "figs"),
    "nightpaw": ("black", "mice"), "thornhog": ("brown", "acorns"), "skysipper": ("pink", "nectar"),
}
COLOURS = sorted({c for c, _ in ANIMALS.values()})
FOODS = sorted({f for _, f in ANIMALS.values()})
MMLU_SUBJECTS = ("invented_geography", "invented_zoology")
CITIES = sorted(COUNTRIES.values())
WEATHER = ("sunny", "rainy", "windy", "cloudy", "snowy")
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_capital", "description": "The capital city of a country.",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "The sum of two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]


def _bench(name: str):
    """benchmark/<name>/bench_sglang.py as a module: its prompt builders make the completion prompts."""
    path = os.path.join(ROOT, "benchmark", name, "bench_sglang.py")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


GSM8K = _bench("gsm8k")
MMLU = _bench("mmlu")


# ---- word problems -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # worked lines, then "#### N" (GSM8K's form)
    value: int

    def line(self) -> dict:
        return {"question": self.question, "answer": self.answer}


def make_problem(rng: random.Random) -> Problem:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        r = a + b
        q = f"{name} has {a} {item}. {other} gives {name} {b} more {item}. How many {item} does {name} have now?"
        work = f"{name} has {a} + {b} = {r} {item}."
    elif kind == 1:
        a = rng.randint(5, 30)
        b = rng.randint(1, a - 1)
        r = a - b
        q = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} does {name} have left?"
        work = f"{name} has {a} - {b} = {r} {item} left."
    elif kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        r = a * b
        q = f"{name} buys {a} boxes of {item}. Each box holds {b} {item}. How many {item} does {name} buy?"
        work = f"{name} buys {a} * {b} = {r} {item}."
    else:
        a, b, c = rng.randint(1, 20), rng.randint(2, 5), rng.randint(2, 9)
        p = b * c
        r = a + p
        q = (f"{name} has {a} {item}. {other} gives {name} {b} bags with {c} {item} in each bag. "
             f"How many {item} does {name} have now?")
        work = f"The bags hold {b} * {c} = {p} {item}. {name} has {a} + {p} = {r} {item}."
    return Problem(q, f"{work}\n#### {r}", r)


def arithmetic_fact(rng: random.Random) -> str:
    """One line of the arithmetic the templates' worked answers do, with their operand ranges."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return f"{a} + {b} = {a + b}"
    if kind == 1:
        a = rng.randint(5, 30)
        b = rng.randint(1, a - 1)
        return f"{a} - {b} = {a - b}"
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"{a} * {b} = {a * b}"
    a, p = rng.randint(1, 20), rng.randint(2, 5) * rng.randint(2, 9)  # the second step of "add a product"
    return f"{a} + {p} = {a + p}"


def heldout_problems() -> list:
    """The held-out GSM8K-style lines (distinct questions; the first 5 are the worked examples)."""
    rng, seen, out = random.Random(HELDOUT_SEED), set(), []
    while len(out) < GSM8K_HELDOUT:
        p = make_problem(rng)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


# ---- multiple choice -----------------------------------------------------------------------------
def _fact_questions(subject: str) -> list:
    """(question, correct answer, pool of wrong answers) for every fact of a subject."""
    if subject == "invented_geography":
        return [(f"What is the capital of {c}?", cap, [x for x in CITIES if x != cap]) for c, cap in COUNTRIES.items()]
    out = []
    for animal, (colour, food) in ANIMALS.items():
        out.append((f"What colour is a {animal}?", colour, [x for x in COLOURS if x != colour]))
        out.append((f"What does a {animal} eat?", food, [x for x in FOODS if x != food]))
    return out


def mc_row(rng: random.Random, question: str, correct: str, wrong: list) -> list:
    """One MMLU CSV row: question, four choices, the letter of the correct one."""
    choices = rng.sample(wrong, 3) + [correct]
    rng.shuffle(choices)
    return [question, *choices, "ABCD"[choices.index(correct)]]


def heldout_mmlu() -> dict:
    """subject -> (dev rows, test rows): one test row per fact with a fixed choice order; dev rows are more."""
    rng, out = random.Random(HELDOUT_SEED), {}
    for subject in MMLU_SUBJECTS:
        facts = _fact_questions(subject)
        test = [mc_row(rng, *f) for f in facts]
        dev = [mc_row(rng, *rng.choice(facts)) for _ in range(MMLU_DEV)]
        while any(row in test for row in dev):
            dev = [mc_row(rng, *rng.choice(facts)) for _ in range(MMLU_DEV)]
        out[subject] = (dev, test)
    return out


def fact_statements() -> list:
    out = [f"The capital of {c} is {cap}." for c, cap in COUNTRIES.items()]
    for animal, (colour, food) in ANIMALS.items():
        out += [f"A {animal} is {colour}.", f"A {animal} eats {food}."]
    return out


# ---- the training stream -------------------------------------------------------------------------
class Corpus:
    """Training documents (text) drawn from `seed`; never a held-out GSM8K question or MMLU test row."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        held = heldout_problems()
        self.shots = held[:5]
        self.held_questions = {p.question for p in held}
        mmlu = heldout_mmlu()
        self.held_rows = {tuple(r) for _, test in mmlu.values() for r in test}
        self.dev = {s: dev for s, (dev, _) in mmlu.items()}
        # Weights per document; a tool chat is ~460 tokens (the tools block, the same every time), a drill ~320:
        # about a sixth of the tokens are tool chats and over a third arithmetic drills.
        self.kinds = [(self.gsm8k_completion, 4), (self.gsm8k_chat, 2), (self.mmlu_completion, 3),
                      (self.facts, 1), (self.json_chat, 1), (self.tool_chat, 1), (self.drill, 3)]

    def problem(self) -> Problem:
        while True:
            p = make_problem(self.rng)
            if p.question not in self.held_questions:
                return p

    def document(self) -> str:
        kinds, weights = zip(*self.kinds)
        return self.rng.choices(kinds, weights)[0]()

    def gsm8k_completion(self) -> str:
        """Shots then a question, as benchmark/gsm8k/bench_sglang.py builds them, then the answer; the shots are
        usually the held-out file's own worked examples (the script always sends those), sometimes fresh ones."""
        n = self.rng.randint(0, 5)
        shots = self.shots[:n] if self.rng.random() < 0.7 else [self.problem() for _ in range(n)]
        p = self.problem()
        prompts, _ = GSM8K.build_prompts([s.line() for s in shots] + [p.line()], n, 1)
        return f"{prompts[0]} {p.answer}\n\nQuestion"

    def gsm8k_chat(self) -> str:
        p = self.problem()
        work, _ = p.answer.split("\n#### ")
        if self.rng.random() < 0.5:
            reply = {"role": "assistant", "content": p.answer}
            return encode_messages([{"role": "user", "content": p.question}, reply])
        reply = {"role": "assistant", "reasoning_content": work, "content": f"The answer is {p.value}."}
        return encode_messages([{"role": "user", "content": p.question}, reply], thinking=True)

    def mmlu_row(self, subject: str) -> list:
        facts = _fact_questions(subject)
        while True:
            row = mc_row(self.rng, *self.rng.choice(facts))
            if tuple(row) not in self.held_rows:
                return row

    def mmlu_completion(self) -> str:
        """A subject header with shots (usually the dev file's), then a question and its letter."""
        subject = self.rng.choice(MMLU_SUBJECTS)
        n = self.rng.randint(0, 5)
        dev = self.dev[subject] if self.rng.random() < 0.7 else [self.mmlu_row(subject) for _ in range(n)]
        row = self.mmlu_row(subject)
        return MMLU.subject_header(subject, dev, n) + MMLU.format_example(row, include_answer=True)

    def facts(self) -> str:
        return " ".join(self.rng.sample(fact_statements(), 6))

    def drill(self) -> str:
        return "\n".join(arithmetic_fact(self.rng) for _ in range(40))

    def json_chat(self) -> str:
        country = self.rng.choice(sorted(COUNTRIES))
        answer = json.dumps({"country": country, "capital": COUNTRIES[country]})
        if self.rng.random() < 0.5:
            user = f"What is the capital of {country}? Answer in JSON with the keys country and capital."
            return encode_messages([{"role": "user", "content": user}, {"role": "assistant", "content": answer}])
        schema = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
                  "required": ["country", "capital"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}
        user = f"What is the capital of {country}?"
        # Compact, as the server's JSON grammar writes it: under a schema the model answers in the form it is held to.
        compact = json.dumps({"country": country, "capital": COUNTRIES[country]}, separators=(",", ":"))
        return encode_messages([{"role": "user", "content": user}, {"role": "assistant", "content": compact}],
                               response_format=fmt)

    def tool_call(self) -> tuple:
        """(user text, function name, arguments, tool result, final answer)."""
        kind = self.rng.randrange(3)
        if kind == 0:
            city, weather = self.rng.choice(CITIES), self.rng.choice(WEATHER)
            return (f"What is the weather in {city}?", "get_weather", {"city": city}, weather,
                    f"It is {weather} in {city}.")
        if kind == 1:
            country = self.rng.choice(sorted(COUNTRIES))
            return (f"Use a tool to find the capital of {country}.", "get_capital", {"country": country},
                    COUNTRIES[country], f"The capital of {country} is {COUNTRIES[country]}.")
        a, b = self.rng.randint(10, 99), self.rng.randint(10, 99)
        return f"Add {a} and {b} with the add tool.", "add", {"a": a, "b": b}, str(a + b), f"{a} + {b} = {a + b}."

    def tool_chat(self) -> str:
        user, name, args, result, final = self.tool_call()
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        if self.rng.random() < 0.5:
            msgs += [{"role": "tool", "tool_call_id": "call_0", "content": result},
                     {"role": "assistant", "content": final}]
        return encode_messages(msgs, tools=TOOLS)


# ---- held-out files ------------------------------------------------------------------------------
def heldout_files() -> dict:
    """Relative path under data/ -> file text, for every held-out file."""
    files = {"gsm8k_test.jsonl": "".join(json.dumps(p.line()) + "\n" for p in heldout_problems())}
    for subject, (dev, test) in heldout_mmlu().items():
        for split, rows in (("dev", dev), ("test", test)):
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            files[os.path.join("mmlu", split, f"{subject}_{split}.csv")] = buf.getvalue()
    return files


def write_heldout(root: str = DATA_DIR) -> None:
    for rel, text in heldout_files().items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the held-out files under data/")
    ap.add_argument("--show", type=int, default=0, help="print this many training documents (seed 0)")
    args = ap.parse_args(argv)
    if args.write:
        write_heldout()
    corpus = Corpus(0)
    for _ in range(args.show):
        sys.stdout.write(corpus.document() + "\n" + "-" * 80 + "\n")


if __name__ == "__main__":
    main()
