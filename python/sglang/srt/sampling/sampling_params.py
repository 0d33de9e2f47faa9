"""SamplingParams: SGLang's per-request sampling options, validated with errors that name the field.

Everything a request can get wrong is refused at admission (`verify`), so a bad value never reaches the model
step, where it would fail the whole batch: numbers must be finite (NaN and inf would poison the softmax), bools
are not numbers, and the seed must fit the 64 bits torch.Generator.manual_seed takes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Optional

import re2

# Below this temperature sampling is greedy (as in SGLang): logits / 1e-40 overflow to inf and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-6
# torch.Generator.manual_seed takes a signed or an unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Fields of upstream SGLang's SamplingParams that we accept at their defaults only (its clients, e.g.
# sglang.test.few_shot_gsm8k, always send them); any other value is refused naming the field.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
UPSTREAM_AT_DEFAULT_ONLY = {
    "n": 1,
    "structural_tag": None, "custom_params": None, "stream_interval": None,
}

# Stop regexes run on RE2, whose search time is linear in the text (a backtracking engine takes exponential time on
# patterns such as (a|aa)+$, and the search runs after every token, in the scheduler loop). Its cost per search is
# at most (bytes searched) x (program size) on RE2's NFA, and usually one DFA step per byte, so both are bounded:
# the text is the last STOP_REGEX_WINDOW output tokens' (at most 32 x 128 bytes with this tokenizer), and a
# request's patterns compile to at most STOP_REGEX_MAX_PROGRAM instructions together.
STOP_REGEX_WINDOW = 32  # output tokens whose text a stop_regex is searched in, after each new token
STOP_REGEX_MAX_LEN = 1000  # characters of one pattern
STOP_REGEX_MAX_PROGRAM = 2000  # RE2 instructions of a request's patterns together (\pL alone takes 1,200)
STOP_REGEX_MAX_SKIPS = 8  # matches within the min_new_tokens text one search steps over (search_stop_regex)


def _re2_options(max_mem: int) -> "re2.Options":
    options = re2.Options()
    options.max_mem = max_mem  # RE2 refuses a pattern whose program would exceed about max_mem / 17 instructions
    options.log_errors = False
    options.never_capture = True  # only the whole match is used
    return options


# Checking the size: RE2 stops compiling past ~3,800 instructions, so a huge pattern is refused in about a millisecond.
_SIZE_CHECK = _re2_options(64 << 10)
# Searching: the program and its DFA caches (a DFA that outgrows them falls back to the slower, still linear NFA).
_SEARCH = _re2_options(1 << 20)


@functools.lru_cache(maxsize=128)
def stop_regex_program_size(pattern: str) -> int:
    """RE2 instructions of a stop_regex pattern; re2.error when RE2 cannot run it (syntax it lacks, such as
    backreferences and lookaround, or a program past the size check)."""
    return re2.compile(pattern, _SIZE_CHECK).programsize


@functools.lru_cache(maxsize=128)  # with re2's own cache of 128: at most ~256 MiB of programs and DFAs
def compile_stop_regex(pattern: str) -> "re2._Regexp":
    """A verified stop_regex pattern (SamplingParams.verify), compiled for searching."""
    return re2.compile(pattern, _SEARCH)


# Stop strings and regexes apply from the min_new_tokens-th output token on: one that the tokens before it complete is
# no stop. `floor` is the length of those tokens' text within the searched text; a match must end past it.

def find_stop(text: str, stop: str, floor: int = 0) -> int:
    """Start of the first occurrence of `stop` in text that ends past text[:floor], or -1 (searches
    text[floor - len(stop) + 1:] only)."""
    return text.find(stop, max(0, floor - len(stop) + 1))


def search_stop_regex(pattern: "re2._Regexp", text: str, floor: int = 0) -> "Optional[re2._Match]":
    """The first match of a compiled stop_regex in text that ends past text[:floor], or None. A match that ends
    within text[:floor] is stepped over (the search goes on from the position after its start) at most
    STOP_REGEX_MAX_SKIPS times; after that only matches that start at the floor or later count. So a search costs at
    most STOP_REGEX_MAX_SKIPS + 2 linear passes over the text, however many matches the min_new_tokens text holds."""
    start = 0
    for _ in range(STOP_REGEX_MAX_SKIPS):
        m = pattern.search(text, start)
        if m is None or m.end() > floor:
            return m
        start = m.start() + 1
    return pattern.search(text, max(start, floor))


def _regex_error(e: "re2.error") -> str:
    reason = e.args[0] if e.args else ""
    return reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)


class SamplingParamError(ValueError):
    """A bad sampling parameter; `param` names it (for the `param` of an OpenAI error body)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # before this many tokens, EOS and stop_token_ids are masked and stop strings ignored
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list = field(default_factory=list)  # strings; a str is accepted and wrapped
    stop_token_ids: list = field(default_factory=list)
    stop_regex: list = field(default_factory=list)  # patterns; a str is accepted and wrapped ("" = none)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    seed: Optional[int] = None
    # Constrained decoding (at most one; constrained/xgrammar_backend.py): a JSON schema as a JSON string ("$$ANY$$":
    # any JSON value), a regular expression, or an EBNF grammar (GBNF syntax, `root` rule)
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    logit_bias: Optional[dict] = None  # {token id (int or its decimal string): bias in [-100, 100]}, added to logits
    # Accepted either way: DeepSeek-V4's byte-level tokenizer never puts spaces between special tokens when decoding
    spaces_between_special_tokens: bool = True

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "SamplingParams":
        """SGLang's /generate `sampling_params`: a null value means the default (as upstream); upstream's fields we
        do not implement are accepted at their defaults only; `sampling_seed` is upstream's name of `seed`."""
        d = {k: v for k, v in (d or {}).items() if v is not None}
        for name, default in UPSTREAM_AT_DEFAULT_ONLY.items():
            value = d.pop(name, default)
            if value != default:
                raise SamplingParamError(name, f"sampling parameter '{name}' is not supported yet: only its default "
                                               f"{default!r} is accepted, got {value!r}"[:300])
        if "sampling_seed" in d:
            seed = d.pop("sampling_seed")
            if d.setdefault("seed", seed) != seed:
                raise SamplingParamError("sampling_seed", "give 'seed' or 'sampling_seed', not two different seeds")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: "
                             f"{sorted(known | set(UPSTREAM_AT_DEFAULT_ONLY) | {'sampling_seed'})}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if isinstance(d.get("stop_regex"), str):
            d["stop_regex"] = [d["stop_regex"]] if d["stop_regex"] else []
        params = cls(**d)
        params.verify()
        return params

    def verify(self) -> None:
        """Raise ValueError naming the first bad field; then normalise a temperature below GREEDY_TEMPERATURE to 0."""
        def bad(name: str, why: str):
            got = repr(getattr(self, name))
            got = got if len(got) <= 80 else got[:77] + "..."  # a 400-digit number or a huge list stays readable
            raise SamplingParamError(name, f"sampling parameter '{name}' {why}, got {got}")

        def number(name: str, ok, why: str) -> None:
            if not _is_finite_number(getattr(self, name)) or not ok(getattr(self, name)):
                bad(name, why)

        def integer(name: str, ok, why: str) -> None:
            if not _is_int(getattr(self, name)) or not ok(getattr(self, name)):
                bad(name, why)

        integer("max_new_tokens", lambda v: v >= 0, "must be a non-negative integer")
        integer("min_new_tokens", lambda v: 0 <= v <= self.max_new_tokens,
                "must be an integer between 0 and max_new_tokens")
        number("temperature", lambda v: v >= 0, "must be a finite number >= 0")
        number("top_p", lambda v: 0 < v <= 1, "must be a number in (0, 1]")
        integer("top_k", lambda v: v >= 1 or v == -1, "must be -1 or an integer >= 1")
        number("min_p", lambda v: 0 <= v <= 1, "must be a number in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            number(name, lambda v: -2 <= v <= 2, "must be a number in [-2, 2]")
        number("repetition_penalty", lambda v: 0 < v <= 2, "must be a number in (0, 2]")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of integers")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(t, str) and t for t in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            bad("stop", "may hold at most 16 strings")
        if not isinstance(self.stop_regex, (list, tuple)) or len(self.stop_regex) > 16 \
                or not all(isinstance(t, str) and t for t in self.stop_regex):
            bad("stop_regex", "must be a pattern or a list of at most 16 non-empty patterns")
        program = 0
        for pattern in self.stop_regex:
            shown = repr(pattern) if len(pattern) <= 60 else repr(pattern[:57]) + "..."
            if len(pattern) > STOP_REGEX_MAX_LEN:
                bad("stop_regex", f"patterns must be at most {STOP_REGEX_MAX_LEN} characters ({shown} has "
                                  f"{len(pattern)})")
            try:
                program += stop_regex_program_size(pattern)
            except re2.error as e:
                why = _regex_error(e)
                if "too large" in why:
                    program = STOP_REGEX_MAX_PROGRAM + 1
                else:
                    bad("stop_regex", f"must hold valid regular expressions in RE2 syntax (no backreferences or "
                                      f"lookaround) ({shown}: {why})")
            if program > STOP_REGEX_MAX_PROGRAM:
                bad("stop_regex", f"patterns are too large: together they must compile to at most "
                                  f"{STOP_REGEX_MAX_PROGRAM} RE2 instructions (reached with {shown})")
            if compile_stop_regex(pattern).search("") is not None:
                bad("stop_regex", f"must not match the empty string ({shown} does)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > 1024:
                bad("logit_bias", "must be an object of at most 1024 token ids to biases")
            parsed = {}
            for key, value in self.logit_bias.items():
                token = key if _is_int(key) else (int(key) if isinstance(key, str) and key.isdigit() else None)
                if token is None or not _is_finite_number(value) or not -100 <= value <= 100:
                    bad("logit_bias", "must map token ids to numbers in [-100, 100]")
                parsed[token] = float(value)
            self.logit_bias = parsed
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", "must be an integer that fits in 64 bits (between -2**63 and 2**64 - 1)")
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                bad(name, "must be a non-empty string")
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            bad(given[1], f"cannot be combined with '{given[0]}': give one grammar")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0

    @property
    def grammar(self) -> Optional[tuple]:
        """(field, text) of the request's constraint, or None."""
        return next(((name, getattr(self, name)) for name in GRAMMAR_FIELDS if getattr(self, name) is not None),
                    None)

    @property
    def has_penalties(self) -> bool:
        """Logit adjustments that read the request's history (min_new_tokens: how many tokens it has so far)."""
        return (self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1
                or self.min_new_tokens > 0)

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit_bias: the logits are changed before sampling (penalize_rows). Only penalties read
        the history, so a logit_bias alone keeps a batch overlappable."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
