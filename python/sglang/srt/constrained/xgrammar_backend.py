"""Constrained decoding with xgrammar (`--grammar-backend xgrammar`, SGLang's default; `none` disables it).

A request with `json_schema`, `regex` or `ebnf` gets a GrammarMatcher before it is admitted: its grammar is compiled
off the scheduler loop (constrained/grammar_queue.py); one that fails to compile, or allows no first token, is a 400
naming the field. Compiled grammars are kept by their text in an LRU cache bounded in bytes (SGLANG_GRAMMAR_CACHE_MB).
Before each sampling, the matcher of every such row fills a token bitmask on the CPU (while the device still runs the
forward: nothing waits for it), the bitmask is copied to the device and applied to the logits, so only tokens the
grammar allows can be drawn. Each committed token advances the matcher; when the grammar is complete the request
stops. JSON is compact (no free whitespace, `,` and `:` without spaces), so a weak model cannot pad it forever.
`json_schema` "$$ANY$$" means any JSON object or array (upstream's "any JSON"); OpenAI's `response_format: {"type":
"json_object"}` is the schema JSON_OBJECT: any object.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Optional

import torch

from sglang.srt.environ import envs
from sglang.srt.sampling.sampling_params import SamplingParamError

ANY_JSON = "$$ANY$$"
JSON_OBJECT = '{"type": "object"}'  # any JSON object (xgrammar: any keys, values of any JSON type)
# What ANY_JSON compiles to: the language of xgrammar's builtin JSON grammar (an object or an array), made compact
ANY_JSON_SCHEMA = '{"type": ["object", "array"]}'
# DeepSeek-V4 thinking mode: reasoning runs free up to </think> (approximated as text without "</" before it)
REASONING_EBNF = 'root ::= ([^<] | "<" [^/])* "</think>"'


class CompiledGrammarCache:
    """Compiled grammars by (kind, text), least recently used evicted first, within `capacity_bytes` (their xgrammar
    size plus the text: one large schema can compile to hundreds of MB). Shared by the compile threads: locked."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._entries: OrderedDict = OrderedDict()  # key -> (compiled, size)
        self._lock = threading.Lock()

    @staticmethod
    def size_of(key: tuple, compiled) -> int:
        return compiled.memory_size_bytes + len(key[1].encode())

    def get(self, key: tuple):
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: tuple, compiled) -> None:
        """Keep `compiled` (evicting the least recently used); one larger than the whole cache is not kept."""
        size = self.size_of(key, compiled)
        with self._lock:
            if key in self._entries or size > self.capacity_bytes:
                return
            while self.nbytes + size > self.capacity_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.nbytes -= evicted
            self._entries[key] = (compiled, size)
            self.nbytes += size

    def keys(self) -> list:
        """Least recently used first."""
        with self._lock:
            return list(self._entries)


class XGrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary and hands out matchers. compile() may run in several threads
    at once (xgrammar releases the GIL while compiling)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list, max_threads: int = 2) -> None:
        import xgrammar

        self.xgr = xgrammar
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        encoded = [""] * min(vocab_size, max(vocab.values()) + 1)  # ids past the model's vocabulary never occur
        for token, i in vocab.items():
            if i < len(encoded):
                encoded[i] = token
        # DeepSeek's tokenizer is byte-level BPE (tokens spell bytes as printable characters)
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=list(stop_token_ids))
        self.vocab_size = vocab_size
        # xgrammar's own cache is unbounded: ours replaces it
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.cache = CompiledGrammarCache(envs.SGLANG_GRAMMAR_CACHE_MB.get() << 20)

    def compile(self, kind: str, text: str):
        """The CompiledGrammar of `kind` (json_schema | regex | ebnf) `text`, from the cache or compiled now;
        SamplingParamError naming the field when the grammar does not compile or allows no first token."""
        key = (kind, text)
        compiled = self.cache.get(key)
        if compiled is not None:
            return compiled
        try:
            if kind == "json_schema":
                schema = ANY_JSON_SCHEMA if text == ANY_JSON else text
                json.loads(schema)  # a clear message for text that is not JSON at all
                compiled = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            else:
                compiled = self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise SamplingParamError(kind, f"{kind} does not compile: {reason}"[:500]) from None
        if not self.allows_any(self.xgr.GrammarMatcher(compiled)):
            raise SamplingParamError(kind, f"{kind} matches no text: it allows no first token")
        self.cache.put(key, compiled)
        return compiled

    def matcher(self, kind: str, text: str):
        """A fresh GrammarMatcher for `kind` `text`, compiled in this thread (compile() for the errors)."""
        return self.new_matcher(self.compile(kind, text))

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allows_any(self, matcher) -> bool:
        """Whether the matcher, in its current state, allows some token (a grammar that compiles may still match
        nothing, or dead-end after a prefix)."""
        bitmask = self.new_bitmask(1)
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = torch.zeros(1, self.vocab_size)
        self.xgr.apply_token_bitmask_inplace(allowed, bitmask, vocab_size=self.vocab_size)
        return bool(torch.isfinite(allowed).any())

    def apply(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """Mask rows of `logits` [B, V] to what their matcher allows (None: no grammar); returns a masked copy."""
        bitmask = self.new_bitmask(len(matchers))
        for b, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, b)
        return self.apply_bitmask(logits, bitmask)

    def fill_verify_rows(self, bitmask: torch.Tensor, first_row: int, matcher, drafts: list) -> None:
        """Speculative verification: rows first_row .. first_row + len(drafts) hold what the grammar allows after the
        committed tokens and then after each draft prefix (the matcher is advanced through the drafts and rolled
        back). A draft the grammar refuses ends it: the target cannot pick it, so nothing after it is accepted."""
        accepted = 0
        for i in range(len(drafts) + 1):
            matcher.fill_next_token_bitmask(bitmask, first_row + i)
            if i == len(drafts) or not matcher.accept_token(drafts[i]):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)  # every token allowed

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [R, V] with the tokens `bitmask` [R, V/32] forbids at -inf."""
        if logits.device.type == "cuda":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        masked = logits.clone()  # the raw logits still give the reported logprobs (speculative verify reads them)
        self.xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=self.vocab_size)
        return masked


def json_after_reasoning(schema: str) -> str:
    """EBNF for DeepSeek-V4's thinking mode: free reasoning up to `</think>` (text without "</" before it), then
    JSON under `schema` (ANY_JSON: an object or an array), compact as above. ValueError when the schema does not
    convert."""
    import xgrammar

    try:
        reasoning = xgrammar.Grammar.from_ebnf(REASONING_EBNF)
        body = xgrammar.Grammar.from_json_schema(ANY_JSON_SCHEMA if schema == ANY_JSON else schema,
                                                 any_whitespace=False, separators=(",", ":"))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"the JSON schema does not compile: {str(e).strip().splitlines()[-1]}") from None
    return str(xgrammar.Grammar.concat(reasoning, body))


def make_grammar_backend(kind: Optional[str], tokenizer, vocab_size: int, stop_token_ids: list):
    """The backend for --grammar-backend, or None (`none`, or no tokenizer: grammar requests are then refused)."""
    if kind in (None, "none") or tokenizer is None:
        return None
    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
