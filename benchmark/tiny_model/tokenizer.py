"""A small byte-level BPE tokenizer for the tiny DeepSeek-V4, trained on its synthetic corpus.

It keeps the DeepSeek-V4 tokenizer's shape where the engine relies on it: BOS / EOS / pad are ids 0 / 1 / 2 (the
config's bos_token_id / eos_token_id), every marker the chat encoding writes (<｜User｜>, <｜Assistant｜>, <think>,
</think>, ｜DSML｜, <｜latest_reminder｜>, the task tokens, ...) is one added token, and BOS / EOS / pad alone are
"special" (skipped when decoding) so the DSML and reasoning markers reach the parsers. Byte-level, so any text
encodes; numbers split into runs of at most three digits as in DeepSeek's pre-tokenizer.
"""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from sglang.srt.entrypoints.openai import encoding_dsv4 as enc

SPECIAL = (enc.BOS, enc.EOS, "<｜▁pad▁｜>")  # ids 0, 1, 2
# Every marker the encoder and parsers use, then the rest of DeepSeek-V4's named added tokens (kept so a prompt
# that holds one tokenizes as it would on the real model).
MARKERS = (enc.USER, enc.ASSISTANT, enc.THINK_OPEN, enc.THINK_CLOSE, enc.DSML, enc.LATEST_REMINDER,
           *enc.TASK_TOKENS.values(), "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<|EOT|>",
           "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
           "<｜tool▁sep｜>", "<｜begin▁sys｜>", "<｜end▁sys｜>", "<｜task｜>", "<｜answer｜>", "<｜search｜>")
DEFAULT_VOCAB = 1024


def train_tokenizer(texts, vocab_size: int = DEFAULT_VOCAB) -> Tokenizer:
    """Byte-level BPE over `texts` (an iterable of strings) holding SPECIAL at ids 0-2 and every marker."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS if tok.token_to_id(m) is None])
    for i, s in enumerate(SPECIAL):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str) -> None:
    """tokenizer.json + tokenizer_config.json (no BOS added on encode: the chat encoding writes it itself)."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": SPECIAL[0], "eos_token": SPECIAL[1],
              "pad_token": SPECIAL[1], "clean_up_tokenization_spaces": False, "model_max_length": 4096,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
