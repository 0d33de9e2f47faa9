"""Process groups of one model instance over torch.distributed (NCCL on NVIDIA, RCCL through the same API on ROCm,
gloo on CPU), and the collectives the sharded layers call.

Layout (distributed/sharding.py holds the split rules): global rank r of `tp` ranks. Attention runs over attn_tp
groups (all tp ranks, or with --enable-dp-attention tp / dp consecutive ranks each); the MoE over all tp ranks,
expert-parallel rank r // moe_tp and MoE tensor-parallel rank r % moe_tp. With tp = 1 nothing is initialised and
every collective is the identity, so the single-GPU engine runs exactly as before.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from sglang.srt.distributed.dp_attention import init_dp_attention
from sglang.srt.distributed.sharding import ParallelConfig, RankCoords


@dataclass
class GroupCoordinator:
    """One process group seen from this rank: the identity when it has one member."""

    ranks: tuple
    rank_in_group: int
    group: Optional[dist.ProcessGroup] = None
    cpu_group: Optional[dist.ProcessGroup] = None  # gloo: Python objects (the scheduler's messages)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every member's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj, src: int = 0):
        """The group's rank-`src` object, on every rank (pickled over gloo)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj) -> list:
        """Every member's `obj`, in rank order, on every rank (pickled over gloo)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


@dataclass
class ParallelState:
    config: ParallelConfig
    rank: int
    tp: GroupCoordinator
    attn_tp: GroupCoordinator

    @property
    def ep_rank(self) -> int:
        return self.rank // self.config.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.config.moe_tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.config.attn_tp if self.config.dp_attention else 0

    @property
    def coords(self) -> RankCoords:
        return RankCoords(tp=self.rank, attn_tp=self.attn_tp.rank_in_group, ep=self.ep_rank, moe_tp=self.moe_tp_rank)


_SINGLE = ParallelState(ParallelConfig(), 0, GroupCoordinator((0,), 0), GroupCoordinator((0,), 0))
_STATE: ParallelState = _SINGLE


def get_parallel_state() -> ParallelState:
    return _STATE


@contextlib.contextmanager
def layout_of_rank(pc: ParallelConfig, rank: int = 0):
    """This process seen as rank `rank` of layout `pc` without joining a world (no process groups: nothing inside may
    communicate). The capacity planner builds a rank's meta model under it, exactly as that rank builds its own (its
    experts, head parts and quantized layouts at their local sizes)."""
    global _STATE
    saved, start = _STATE, rank - rank % pc.attn_tp
    _STATE = ParallelState(pc, rank, GroupCoordinator(tuple(range(pc.tp)), rank),
                           GroupCoordinator(tuple(range(start, start + pc.attn_tp)), rank - start))
    try:
        yield _STATE
    finally:
        _STATE = saved


def init_parallel_state(pc: ParallelConfig, rank: int, backend: str, init_method: str,
                        timeout_s: float = 300.0) -> ParallelState:
    """Join the world of pc.tp ranks and build the groups (every rank must call this, in the same order).
    `timeout_s` bounds every collective: a rank that died or hangs fails the others' next collective with an error
    instead of a silent hang."""
    global _STATE
    if pc.tp == 1:
        _STATE = _SINGLE
        return _STATE
    if not 0 <= rank < pc.tp:
        raise ValueError(f"rank {rank} outside [0, {pc.tp})")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=pc.tp,
                                timeout=datetime.timedelta(seconds=timeout_s))
    world = tuple(range(pc.tp))
    cpu = dist.group.WORLD if backend == "gloo" else dist.new_group(list(world), backend="gloo")
    tp = GroupCoordinator(world, rank, dist.group.WORLD, cpu)
    attn_tp = tp
    if pc.dp_attention and pc.attn_tp < pc.tp:
        for start in range(0, pc.tp, pc.attn_tp):  # every rank creates every group, as new_group requires
            ranks = tuple(range(start, start + pc.attn_tp))
            group = dist.new_group(list(ranks))
            cpu_group = group if backend == "gloo" else dist.new_group(list(ranks), backend="gloo")
            if rank in ranks:
                attn_tp = GroupCoordinator(ranks, rank - start, group, cpu_group)
    elif pc.attn_tp == 1:
        attn_tp = GroupCoordinator((rank,), 0)
    _STATE = ParallelState(pc, rank, tp, attn_tp)
    init_dp_attention(tp, pc.dp if pc.dp_attention else 1, pc.attn_tp, _STATE.dp_rank, attn_tp)
    return _STATE


def destroy_parallel_state() -> None:
    """Leave the world: every rank calls this once its collectives are done. The barrier keeps a rank from tearing
    down its connections while a peer still uses them; destroying the groups explicitly, before the interpreter
    finalizes, keeps gloo's worker threads from aborting the process at exit (SIGABRT, "terminate called without
    an active exception")."""
    global _STATE
    if dist.is_initialized():
        dist.barrier(group=_STATE.tp.cpu_group)
        dist.destroy_process_group()
    _STATE = _SINGLE
    init_dp_attention(None, 1, 1, 0)
