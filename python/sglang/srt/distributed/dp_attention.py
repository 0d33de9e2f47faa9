"""Data-parallel attention (--enable-dp-attention --dp N): N groups of attn_tp = tp / N ranks each run their own
requests through attention, and every MoE runs over the tokens of all groups (the DeepSeek serving layout).

Every forward of a model is a round of the whole world: each rank says what it runs (its kind: "main" for the
target model, "draft0".. for the MTP layers; and its number of tokens, the same on every rank of a DP group) in one
object all-gather. A round runs one kind ("main" first, else the lowest draft step): the groups that asked for
another kind run an idle forward of it and ask again, a rank done with its step answers "done" and does the same
until every rank is done. An idle forward runs that model's MoE layers with no tokens of its own (its experts still
serve the other groups' tokens), so every rank meets every collective in the same order. Inside a forward each
MoE gathers the groups' tokens (one all-gather over the world of the groups' rows padded to the largest group, each
rank of a group sending its 1/attn_tp of them), computes its experts' and shared-expert part for all of them, and
sums the parts with one reduce-scatter that leaves each rank its 1/attn_tp of its own group's rows (then an
all-gather inside the attention-TP group when attn_tp > 1): half the bytes of an all-reduce of every row.

Static rounds (CUDA graphs): a DECODE step on the static path opens its round before the graph replays
(`open_round`, the host exchange outside the graph) and asks for a static one. When every group running that kind
asked so, the round is static: every busy group runs the largest of their padded batch sizes (a captured size), and
the MoE exchange keeps every padded row (fixed shapes, no index built from the counts), so the replayed collectives
match; idle groups serve it eagerly with zero rows of that size. Otherwise the static step runs its rows eagerly in
an ordinary round. At capture, every rank captures the same sizes in the same order on static rounds it sets itself.

With dp = 1 none of this runs: `DpAttention.active` is False and the model calls nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

DONE = "done"


@dataclass
class DpForward:
    """The current round: its kind ("main", or "draftJ" for MTP layer J) and every DP group's tokens in it."""

    kind: str
    counts: list  # tokens per DP group, in group order
    group: int  # this rank's DP group
    pad: int = 0  # rows per group in the padded exchange: the largest count, rounded up to a multiple of attn_tp
    real_rows: Optional[torch.Tensor] = None  # the padded rows holding tokens (set at the first gather)
    static: bool = False  # a static round: every padded row goes through the MoE (fixed shapes, graph-safe)


class DpAttention:
    def __init__(self, world, dp: int, attn_tp: int, dp_rank: int, attn_group=None) -> None:
        self.world, self.dp, self.attn_tp, self.dp_rank = world, dp, attn_tp, dp_rank
        self.attn_group = attn_group  # this rank's attention-TP group (GroupCoordinator)
        self.idle: dict = {}  # kind -> the idle forward of that model (registered by the ModelRunner)
        self.current: Optional[DpForward] = None
        self.opened: Optional[str] = None  # the kind whose round a static step opened before its forward
        self.num_static_rounds = 0  # rounds run static (tests and logs)
        self.input_ids: Optional[torch.Tensor] = None  # every group's input ids of the current forward (hash routing)

    @property
    def active(self) -> bool:
        return self.dp > 1

    # ---- rounds ----------------------------------------------------------------------------------------------
    def _exchange(self, kind: str, num_tokens: int, static: bool = False) -> list:
        """(kind, tokens, static) of every world rank, in rank order."""
        box = [None] * self.world.world_size
        dist.all_gather_object(box, (kind, num_tokens, static), group=self.world.cpu_group)
        return box

    def _round(self, entries: list) -> Optional[DpForward]:
        """The round's kind ("main" first, else the lowest draft step), each group's tokens in it (0 for a group
        that asked for another kind or is done) and whether it is static (every group of that kind asked so); None
        when every rank is done."""
        kinds = {k for k, _, _ in entries if k != DONE}
        if not kinds:
            return None
        kind = "main" if "main" in kinds else min(kinds)
        leaders = [entries[g * self.attn_tp] for g in range(self.dp)]
        counts = [n if k == kind else 0 for k, n, _ in leaders]
        static = all(st for k, _, st in leaders if k == kind)
        self.num_static_rounds += static
        return self._forward(kind, counts, static)

    def _forward(self, kind: str, counts: list, static: bool) -> DpForward:
        return DpForward(kind, counts, self.dp_rank, -(-max(counts) // self.attn_tp) * self.attn_tp, static=static)

    def _serve(self, fwd: DpForward) -> None:
        """An idle forward of the round's kind: this group has no tokens in it."""
        self.current = fwd
        fn: Callable = self.idle[fwd.kind]
        fn()

    def begin_forward(self, kind: str, input_ids: torch.Tensor) -> DpForward:
        """Called by a model at the start of each forward: waits (serving other kinds' rounds) for a round of its
        kind, unless a static step opened it already; then every group's counts and input ids are known."""
        if self.opened == kind:
            self.opened = None
        else:
            self._await(kind, int(input_ids.shape[0]), False)
        self.input_ids = self.gather(input_ids)
        return self.current

    def open_round(self, kind: str, num_tokens: int) -> DpForward:
        """A static step's round, opened before its forward (outside any graph): static when every group of that
        kind asked for one (then every busy group runs max(counts) rows), else an ordinary round."""
        fwd = self._await(kind, num_tokens, True)
        self.opened = kind
        return fwd

    def static_round(self, kind: str, num_tokens: int) -> None:
        """Capture: a static round of `num_tokens` rows in every group, set without an exchange (every rank captures
        the same sizes in the same order)."""
        self.current, self.opened = self._forward(kind, [num_tokens] * self.dp, True), kind

    def close_round(self) -> None:
        """After a replayed graph (which ran no Python): the opened round is spent."""
        self.opened = None

    def _await(self, kind: str, num_tokens: int, static: bool) -> DpForward:
        while True:
            fwd = self._round(self._exchange(kind, num_tokens, static))
            if fwd.kind == kind:
                self.current = fwd
                return fwd
            self._serve(fwd)

    def finish_round(self) -> None:
        """After this rank's step: serve idle forwards until every rank is done."""
        while True:
            fwd = self._round(self._exchange(DONE, 0))
            if fwd is None:
                self.current = None
                return
            self._serve(fwd)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (the loop's "anyone has work")."""
        box = [None] * self.world.world_size
        dist.all_gather_object(box, bool(flag), group=self.world.cpu_group)
        return any(box)

    # ---- tokens ----------------------------------------------------------------------------------------------
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This group's rows `x` [n, ...] -> every group's rows, in group order. One all-gather over the world of
        [pad / attn_tp] rows per rank: group g's rows land at [g * pad, (g + 1) * pad), each of its ranks sending its
        slice (the ranks of a group hold the same rows); the padding is then dropped."""
        fwd = self.current
        if fwd.pad == 0:
            return x[:0]
        part = fwd.pad // self.attn_tp
        a = self.world.rank_in_group % self.attn_tp
        mine = x[a * part:(a + 1) * part]
        if mine.shape[0] < part:
            mine = torch.cat((mine, mine.new_zeros((part - mine.shape[0],) + tuple(x.shape[1:]))))
        full = x.new_empty((self.world.world_size * part,) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(full, mine.contiguous(), group=self.world.group)
        return full if fwd.static else full[self._real_rows(fwd, x.device)]

    def own_rows(self) -> slice:
        """Where this group's rows lie in `gather`'s result: its padded rows in a static round, else its real ones."""
        fwd = self.current
        if fwd.static:
            return slice(fwd.group * fwd.pad, (fwd.group + 1) * fwd.pad)
        start = sum(fwd.counts[:fwd.group])
        return slice(start, start + fwd.counts[fwd.group])

    def _real_rows(self, fwd: DpForward, device) -> torch.Tensor:
        if fwd.real_rows is None:  # once per round: every MoE layer's gather and reduce use it
            rows = torch.cat([torch.arange(n, dtype=torch.int64) + g * fwd.pad for g, n in enumerate(fwd.counts)])
            fwd.real_rows = rows.to(device, non_blocking=True)
        return fwd.real_rows

    def reduce_own(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's partial sums over all groups' rows -> this group's rows of the total: the rows back in the
        padded layout, one reduce-scatter over the world (each rank gets its slice of its own group's rows), and an
        all-gather of the slices inside the attention-TP group."""
        fwd = self.current
        n = fwd.counts[fwd.group]
        if fwd.pad == 0:
            return y[:0]
        part = fwd.pad // self.attn_tp
        if fwd.static:  # y has every padded row already
            padded = y
        else:
            padded = y.new_zeros((self.dp * fwd.pad,) + tuple(y.shape[1:]))
            padded[self._real_rows(fwd, y.device)] = y
        mine = y.new_empty((part,) + tuple(y.shape[1:]))
        dist.reduce_scatter_tensor(mine, padded, group=self.world.group)
        if self.attn_tp > 1:
            mine = self.attn_group.all_gather(mine, dim=0)
        return mine[:n]


_NONE = DpAttention(None, 1, 1, 0)
_DP: DpAttention = _NONE


def get_dp_attention() -> DpAttention:
    return _DP


def init_dp_attention(world, dp: int, attn_tp: int, dp_rank: int, attn_group=None) -> DpAttention:
    global _DP
    _DP = DpAttention(world, dp, attn_tp, dp_rank, attn_group) if dp > 1 else _NONE
    return _DP
