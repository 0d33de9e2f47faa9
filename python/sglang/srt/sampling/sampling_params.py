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
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "SamplingParams":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
