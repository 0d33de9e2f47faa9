"""Disaggregation over several TP ranks, the pure parts: which prefill rank writes which decode rank (every decode
rank exactly once, for any two sizes), each decode rank's destinations from the same Regions over its own buffers,
a registration carrying every rank's destinations through the wire format (and refused when a rank's addresses do
not pair with the lengths), the error of a room from its ranks' write outcomes, and the transfer engine's address on
each node. Under a second."""

from __future__ import annotations

import pytest

from sglang.srt.disaggregation.kv_state import Region
from sglang.srt.disaggregation.messages import MessageError, RoomRegistration, decode_message, encode_message
from sglang.srt.disaggregation.ranks import (
    RankBuffers, decode_targets, first_error, rank_destinations, source_rank)
from sglang.srt.disaggregation.transfer import RegisteredBuffer


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (1, 4), (2, 2), (4, 4), (2, 4), (4, 2), (3, 8), (8, 1)])
def test_every_decode_rank_is_written_by_exactly_one_prefill_rank(prefill_tp, decode_tp):
    targets = [decode_targets(p, prefill_tp, decode_tp) for p in range(prefill_tp)]
    assert sorted(d for t in targets for d in t) == list(range(decode_tp))
    for p, t in enumerate(targets):
        assert all(source_rank(d, prefill_tp) == p for d in t)
    if prefill_tp == decode_tp:  # equal sizes: rank to rank
        assert targets == [[p] for p in range(prefill_tp)]


def test_pairing_refuses_impossible_ranks():
    with pytest.raises(ValueError, match="outside"):
        decode_targets(2, 2, 4)
    with pytest.raises(ValueError, match="at least one rank"):
        decode_targets(0, 2, 0)
    with pytest.raises(ValueError, match="no prefill rank"):
        source_rank(0, 0)


def _rank(session: str, base: int) -> RankBuffers:
    return RankBuffers(session, [RegisteredBuffer("a", base, 4096), RegisteredBuffer("b", base + 8192, 1024)])


def test_each_decode_rank_gets_the_same_regions_in_its_own_buffers():
    regions = [Region(0, 64, 128), Region(1, 0, 32)]
    lengths, dests = rank_destinations([_rank("h:1", 0x10000), _rank("h:2", 0x90000)], regions)
    assert lengths == [128, 32]
    assert dests == [("h:1", [0x10000 + 64, 0x10000 + 8192]), ("h:2", [0x90000 + 64, 0x90000 + 8192])]
    odd = RankBuffers("h:3", [RegisteredBuffer("a", 0, 4096)])
    with pytest.raises(ValueError, match="decode rank 1 registered buffers unlike rank 0's"):
        rank_destinations([_rank("h:1", 0), odd], regions)


def test_a_registration_carries_every_decode_rank():
    reg = RoomRegistration(3, "r", "h:1", [10, 20], [4, 8], "", [["h:2", [110, 120]], ["h:3", [210, 220]]])
    back = decode_message(encode_message(reg))
    assert back == reg
    assert back.destinations() == [("h:1", [10, 20]), ("h:2", [110, 120]), ("h:3", [210, 220])]
    assert decode_message(encode_message(RoomRegistration(3, "r", "h:1", [10], [4]))).destinations() == [
        ("h:1", [10])]
    for bad in ([["h:2", [110]]], [["h:2"]], [[5, [1, 2]]], [["h:2", [-1, 2]]]):
        with pytest.raises(MessageError) as e:
            decode_message(encode_message(RoomRegistration(3, "r", "h:1", [10, 20], [4, 8], "", bad)))
        assert e.value.param == "rank_destinations"


def test_a_room_fails_when_any_rank_failed_naming_it():
    assert first_error({0: None}) is None
    assert first_error({0: None, 1: None}) is None
    assert first_error({0: "refused"}) == "refused"
    assert first_error({1: "peer gone", 0: None}) == "prefill rank 1: peer gone"


def test_transfer_engine_address_per_node():
    from sglang.srt.managers.scheduler_process import transfer_hostname
    from sglang.srt.server_args import ServerArgs

    args = dict(model_path="m", disaggregation_mode="prefill", tp_size=4)
    assert transfer_hostname(ServerArgs(host="10.0.0.1", **args)) == "10.0.0.1"
    assert transfer_hostname(ServerArgs(host="0.0.0.0", **args)) is None
    # another node's ranks do not run where --host (node 0's address) names: they name their own host
    assert transfer_hostname(ServerArgs(host="10.0.0.1", nnodes=2, node_rank=1, **args)) is None
