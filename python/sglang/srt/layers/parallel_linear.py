"""Vocabulary-parallel embedding and LM head: each tensor-parallel rank holds ceil(V / tp) consecutive rows (the last
rank's part zero-padded, see distributed/sharding.py). With one rank they are nn.Embedding / a bias-free nn.Linear.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import GroupCoordinator


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its rows (zeros for the others); one all-reduce sums the parts."""

    def __init__(self, vocab_size: int, hidden_size: int, group: GroupCoordinator) -> None:
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        self.rows = math.ceil(vocab_size / group.world_size)
        self.start = group.rank_in_group * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered from every rank and cut to the vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, group: GroupCoordinator) -> None:
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        self.weight = nn.Parameter(torch.empty(math.ceil(vocab_size / group.world_size), hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.group.world_size == 1:
            return logits
        return self.group.all_gather(logits, dim=-1)[..., :self.vocab_size]
