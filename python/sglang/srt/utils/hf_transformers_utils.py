"""The checkpoint's tokenizer, loaded the same way by sglang.Engine, the HTTP process and the scheduler process."""

from __future__ import annotations

import os


def load_tokenizer(path: str):
    """The checkpoint's tokenizer.json (the DeepSeek-V4 tokenizer) as a `tokenizers.Tokenizer`, or None if the
    directory has none (then prompts must be token ids and stop strings are refused)."""
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(file) if os.path.exists(file) else None
