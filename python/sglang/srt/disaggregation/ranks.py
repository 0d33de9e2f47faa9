"""Prefill/decode disaggregation over several tensor-parallel ranks on either side: which prefill rank writes which
decode rank, where each decode rank's bytes go, and how the ranks of one server agree on every room's fate.

What travels is replicated over the ranks (distributed/sharding.py): V4 attends with one shared K=V head, the
compressors, the lightning indexer and the MTP layer's inputs are replicated, and the logits are gathered to the
whole vocabulary before the draft distribution is taken. So every prefill rank holds the same bytes for a request,
and decode rank d is written by prefill rank d % prefill_tp, whatever the two sizes (prefill ranks beyond the
decode side's count write nothing). A buffer that a layout split over the ranks would hold fewer bytes per row the
more ranks there are: `kv_state.check_same_layout` then refuses a peer of another size, naming the buffer.

The ranks of one server run the same scheduler in lockstep (managers/scheduler_process.py): a request holds the same
pages, window slots and request slot on each, so one list of Regions describes its bytes on every rank, each over
that rank's own registered buffers (`RankBuffers`, exchanged once at start). Only the first rank talks to the peer
server (the bootstrap server, or its client); once a loop every rank hands the others a `RankReport`: the first
rank what it heard from the peer, every rank the rooms whose writes from it ended and whether its pools are free.
Every rank then applies the same events in the same order, so a room is written, completed, failed or freed on all
ranks at the same point of their loops, and its completion notice leaves only once every rank's write has ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang.srt.disaggregation.kv_state import region_addresses


def source_rank(decode_rank: int, prefill_tp: int) -> int:
    """The prefill rank that writes decode rank `decode_rank`'s bytes."""
    if prefill_tp < 1 or decode_rank < 0:
        raise ValueError(f"no prefill rank for decode rank {decode_rank} of a prefill server of {prefill_tp} rank(s)")
    return decode_rank % prefill_tp


def decode_targets(prefill_rank: int, prefill_tp: int, decode_tp: int) -> list:
    """The decode ranks prefill rank `prefill_rank` writes (every decode rank is written by exactly one)."""
    if not 0 <= prefill_rank < prefill_tp:
        raise ValueError(f"prefill rank {prefill_rank} is outside [0, {prefill_tp})")
    if decode_tp < 1:
        raise ValueError(f"a decode server has at least one rank, got {decode_tp}")
    return [d for d in range(decode_tp) if source_rank(d, prefill_tp) == prefill_rank]


@dataclass(frozen=True)
class RankBuffers:
    """One decode rank's transfer session and registered pool buffers (transfer.RegisteredBuffer, in
    kv_state.transfer_buffers order)."""

    session_id: str
    buffers: list

    def addresses(self, regions: list) -> list:
        """[(address, nbytes)] of `regions` in this rank's buffers."""
        return region_addresses(self.buffers, regions)


def rank_destinations(ranks: list, regions: list) -> tuple:
    """The destinations of one request on every decode rank (RankBuffers, rank order), from its Regions (the same
    on every rank): (lengths, [(session_id, dst_addrs)] per rank). ValueError when the ranks' buffers differ in
    number or size (they pool alike by construction: a rank that does not is a bug, named here)."""
    first = ranks[0]
    shape = [b.nbytes for b in first.buffers]
    per_rank, lengths = [], None
    for rank, buffers in enumerate(ranks):
        if [b.nbytes for b in buffers.buffers] != shape:
            raise ValueError(f"decode rank {rank} registered buffers unlike rank 0's: the ranks pool differently")
        addrs = buffers.addresses(regions)
        lengths = lengths or [n for _, n in addrs]
        per_rank.append((buffers.session_id, [a for a, _ in addrs]))
    return lengths or [], per_rank


@dataclass
class RankReport:
    """What one rank of a server tells the others once a loop. From the first rank only: `failed` (room, why) of
    rooms the bootstrap server ended, `ready` (RoomRegistration) of rooms whose writes start now (prefill);
    `expired` rooms queued for pages past their deadline, `results` (RoomResult) of rooms that ended and `released`,
    how many of the oldest held failed rooms' slots are free to reuse (decode).
    From every rank: `written` room -> error (None: done) of the writes from this rank that ended since its last
    report, and `pools_free` (allocator.is_all_free)."""

    failed: list = field(default_factory=list)
    ready: list = field(default_factory=list)
    expired: list = field(default_factory=list)
    results: list = field(default_factory=list)
    released: int = 0
    written: dict = field(default_factory=dict)
    pools_free: bool = False


def first_error(errors: dict):
    """The error of a room's writes once every rank's ended (rank -> error or None): None when all landed, else the
    first failed rank's error, naming the rank when there are several."""
    for rank in sorted(errors):
        if errors[rank] is not None:
            return errors[rank] if len(errors) == 1 else f"prefill rank {rank}: {errors[rank]}"
    return None
