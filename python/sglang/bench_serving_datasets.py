"""Datasets of bench_serving (python -m sglang.bench_serving --dataset-name ...): rows of prompt, prompt length and
output length.

- `random` / `random-ids`: random texts / token ids of the tokenizer (offline);
- `sharegpt`: first human turns of a ShareGPT JSON file;
- `generated-shared-prefix`: groups of questions sharing a long random system prompt (the prefix cache's best case);
- `multi-turn`: sessions of several turns; each turn is sent after the previous answer, with the whole conversation
  before it (what agentic and chat clients do: the prefix cache reuses the history). Rows hold each turn's new text;
  bench_serving builds the prompt from the history when it sends the turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from typing import Optional, Union

import numpy as np
from tokenizers import Tokenizer


@dataclasses.dataclass
class DatasetRow:
    prompt: Union[str, list]  # text, token ids (random-ids), or chat messages (a multi-turn turn as sent)
    prompt_len: int
    output_len: int
    session: Optional[int] = None  # multi-turn: the conversation, whose turns are sent one after the other


def _lengths(rng: np.random.Generator, full: int, ratio: float, n: int) -> list[int]:
    """Uniform in [ratio * full, full] (at least 1), as SGLang's --random-range-ratio; 1.0 fixes the length."""
    return rng.integers(max(int(full * ratio), 1), full + 1, size=n).tolist()


def _plain_ids(tok: Tokenizer) -> np.ndarray:
    # Special tokens (BOS, DSML markers, ...) would change how the server parses a random prompt.
    special = set(tok.get_added_tokens_decoder())
    return np.array([i for i in range(tok.get_vocab_size()) if i not in special])


def _random_token_lists(tok: Tokenizer, rng: np.random.Generator, lens: list[int]) -> list[list[int]]:
    vocab = _plain_ids(tok)
    return [rng.choice(vocab, size=n).tolist() for n in lens]


def _random_texts(tok: Tokenizer, rng: np.random.Generator, lens: list[int]) -> list[str]:
    """Texts of about `lens` tokens each: random ids, decoded, re-encoded and cut to length (decoding
    merges or splits pieces, so the raw ids would not round-trip), then decoded again."""
    vocab = _plain_ids(tok)
    texts = tok.decode_batch(_random_token_lists(tok, rng, lens))
    ids = []
    for enc, n in zip(tok.encode_batch(texts, add_special_tokens=False), lens):
        cut = enc.ids[:n]
        ids.append(cut + rng.choice(vocab, size=n - len(cut)).tolist())
    return tok.decode_batch(ids)


def _encoded_lens(tok: Tokenizer, texts: list[str]) -> list[int]:
    return [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]


def sample_random(args: argparse.Namespace, tok: Tokenizer, rng: np.random.Generator) -> list[DatasetRow]:
    in_lens = _lengths(rng, args.random_input_len, args.random_range_ratio, args.num_prompts)
    out_lens = _lengths(rng, args.random_output_len, args.random_range_ratio, args.num_prompts)
    if args.dataset_name == "random-ids":
        ids = _random_token_lists(tok, rng, in_lens)
        return [DatasetRow(p, len(p), o) for p, o in zip(ids, out_lens)]
    texts = _random_texts(tok, rng, in_lens)
    return [DatasetRow(t, n, o) for t, n, o in zip(texts, _encoded_lens(tok, texts), out_lens)]


def sample_sharegpt(args: argparse.Namespace, tok: Tokenizer) -> list[DatasetRow]:
    """First human turn as the prompt; the reply's length (or --sharegpt-output-len) as the output length."""
    if not args.dataset_path:
        raise SystemExit("--dataset-name sharegpt needs --dataset-path "
                         "(e.g. ShareGPT_V3_unfiltered_cleaned_split.json)")
    with open(args.dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [(c[0]["value"], c[1]["value"]) for c in (d.get("conversations", []) for d in data) if len(c) >= 2]
    random.Random(args.seed).shuffle(pairs)
    rows = []
    for prompt, reply in pairs:
        if len(rows) == args.num_prompts:
            break
        prompt_len = len(tok.encode(prompt, add_special_tokens=False).ids)
        output_len = args.sharegpt_output_len or len(tok.encode(reply, add_special_tokens=False).ids)
        if prompt_len < 2 or output_len < 2:  # too short to time
            continue
        if args.sharegpt_context_len and prompt_len + output_len > args.sharegpt_context_len:
            continue
        rows.append(DatasetRow(prompt, prompt_len, output_len))
    if len(rows) < args.num_prompts:
        print(f"sharegpt: only {len(rows)} usable conversations (asked for {args.num_prompts})")
    return rows


def sample_generated_shared_prefix(args: argparse.Namespace, tok: Tokenizer,
                                   rng: np.random.Generator) -> list[DatasetRow]:
    """--gsp-num-groups random system prompts, each shared by --gsp-prompts-per-group random questions
    (exercises the prefix cache). Ignores --num-prompts, like SGLang."""
    groups, per_group = args.gsp_num_groups, args.gsp_prompts_per_group
    systems = _random_texts(tok, rng, [args.gsp_system_prompt_len] * groups)
    questions = _random_texts(tok, rng, [args.gsp_question_len] * (groups * per_group))
    texts = [f"{systems[i // per_group]}\n\n{q}" for i, q in enumerate(questions)]
    rows = [DatasetRow(t, n, args.gsp_output_len) for t, n in zip(texts, _encoded_lens(tok, texts))]
    random.Random(args.seed).shuffle(rows)
    return rows


def sample_multi_turn(args: argparse.Namespace, tok: Tokenizer, rng: np.random.Generator) -> list[DatasetRow]:
    """--mt-num-sessions conversations of --mt-turns turns: a first message of --mt-first-len tokens, then
    --mt-turn-len new tokens per turn, --mt-output-len answer tokens each. Rows in session order, each session's
    turns in order (ignores --num-prompts)."""
    sessions, turns = args.mt_num_sessions, args.mt_turns
    lens = [args.mt_first_len if t == 0 else args.mt_turn_len for _ in range(sessions) for t in range(turns)]
    texts = _random_texts(tok, rng, lens)
    return [DatasetRow(text, n, args.mt_output_len, session=i // turns)
            for i, (text, n) in enumerate(zip(texts, _encoded_lens(tok, texts)))]


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", default=None,
                   choices=["sharegpt", "random", "random-ids", "generated-shared-prefix", "multi-turn"],
                   help="default: sharegpt when --dataset-path is given, else random (offline: random token ids "
                        "of the tokenizer, no file or download)")
    p.add_argument("--dataset-path", default="", help="ShareGPT JSON for --dataset-name sharegpt")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt")
    p.add_argument("--sharegpt-context-len", type=int, default=None, help="drop conversations longer than this")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [ratio * len, len]; 1.0 = fixed lengths")
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--mt-num-sessions", type=int, default=32, help="multi-turn: conversations")
    p.add_argument("--mt-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--mt-first-len", type=int, default=2048, help="multi-turn: tokens of the first message")
    p.add_argument("--mt-turn-len", type=int, default=128, help="multi-turn: new tokens of each later message")
    p.add_argument("--mt-output-len", type=int, default=128, help="multi-turn: answer tokens per turn")


def get_dataset(args: argparse.Namespace, tok: Tokenizer) -> list[DatasetRow]:
    rng = np.random.default_rng(args.seed)
    if args.dataset_name in ("random", "random-ids"):
        return sample_random(args, tok, rng)
    if args.dataset_name == "sharegpt":
        return sample_sharegpt(args, tok)
    if args.dataset_name == "multi-turn":
        return sample_multi_turn(args, tok, rng)
    return sample_generated_shared_prefix(args, tok, rng)
