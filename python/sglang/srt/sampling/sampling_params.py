"""SamplingParams: SGLang's per-request sampling options, validated with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list = field(default_factory=list)  # strings; a str is accepted and wrapped
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    seed: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "SamplingParams":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        for key in ("stop_token_ids", "stop"):
            if d.get(key) is None:
                d.pop(key, None)
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        params = cls(**d)
        params.verify()
        return params

    def verify(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"sampling parameter '{name}' {why}, got {getattr(self, name)!r}")

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be a non-negative integer")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "must be -1 or >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of integers")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                bad(name, "must be in [-2, 2]")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", "must be in (0, 2]")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(t, str) and t for t in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            bad("stop", "may hold at most 16 strings")

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
