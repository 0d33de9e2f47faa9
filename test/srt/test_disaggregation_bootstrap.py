"""The rooms of prefill/decode disaggregation (disaggregation/bootstrap.py, messages.py) over real ZMQ sockets on
loopback, with a fake clock for the timeouts: a room registered by the decode side and expected by the prefill side,
in either order, ends with the first token on the decode side; a room registered twice, reused, or whose other half
never comes, a prefill-side failure and a decode-side cancel each end the room on both sides with a clear error;
a prefill server that goes away fails its rooms at once; malformed messages are dropped. About 1 s."""

from __future__ import annotations

import time

import pytest

from sglang.srt.disaggregation.bootstrap import BootstrapClient, BootstrapServer, RoomError, _Peer
from sglang.srt.disaggregation.messages import (BootstrapInfo, CompletionNotice, MessageError, RoomRegistration,
                                                decode_message, encode_message)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def pair():
    clock = Clock()
    server = BootstrapServer("127.0.0.1", 0, room_timeout_s=30, clock=clock)
    client = BootstrapClient("127.0.0.1:5555", room_timeout_s=40, cancel_grace_s=5, clock=clock)
    yield server, client, clock
    client.close()
    server.close()


def until(fn, what: str):
    """fn()'s first non-empty answer (messages cross real sockets); fails after 5 s."""
    for _ in range(500):
        got = fn()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"no {what} within 5 s")


def info(server, room: int) -> BootstrapInfo:
    return BootstrapInfo("127.0.0.1", server.port, room)


def test_a_room_ends_with_the_first_token_whichever_half_comes_first(pair):
    server, client, _ = pair
    client.register(info(server, 7), "req-d", [0x1000, 0x2000], [64, 128])  # decode first
    until(lambda: server.poll().ready or server.registration(7), "registration")
    assert server.poll().ready == []  # not expected yet: not ready
    server.expect(7, "req-p")
    reg = until(lambda: server.poll().ready, "ready room")[0]
    assert reg == RoomRegistration(7, "req-d", "127.0.0.1:5555", [0x1000, 0x2000], [64, 128])
    assert server.take(7) == reg
    server.complete(7, first_token_id=42, first_token_logprob=-0.5, nbytes=192, cached_tokens=3)
    result = until(client.poll, "result")[0]
    assert (result.room, result.rid, result.ok, result.first_token_id, result.first_token_logprob, result.nbytes,
            result.cached_tokens) == (7, "req-d", True, 42, -0.5, 192, 3)
    assert client.num_pending == 0 and server.rooms == {}

    server.expect(8, "req-p2")  # prefill first
    client.register(info(server, 8), "req-d2", [0x1000], [64])
    assert until(lambda: server.poll().ready, "ready room")[0].rid == "req-d2"


def test_reused_and_doubly_registered_rooms_are_refused(pair):
    server, client, _ = pair
    server.expect(1, "a")
    with pytest.raises(RoomError, match="already used"):
        server.expect(1, "b")  # a second prefill request with the room
    client.register(info(server, 1), "d", [0x10], [8])
    with pytest.raises(RoomError, match="already used"):
        client.register(info(server, 1), "e", [0x10], [8])  # a second decode request here
    until(lambda: server.poll().ready, "ready room")
    server.take(1)
    server.complete(1, 5)
    assert until(client.poll, "result")[0].ok

    client.register(info(server, 1), "f", [0x10], [8])  # the room again, once it ended: refused, a 4xx
    result = until(lambda: (server.poll(), client.poll())[1], "refusal")[0]
    assert not result.ok and result.status_code == 400 and "already registered or used" in result.error
    with pytest.raises(RoomError):
        server.expect(1, "g")

    other = BootstrapClient("127.0.0.1:6666")  # another decode server registers a room this one holds
    try:
        client.register(info(server, 2), "h", [0x10], [8])
        until(lambda: server.poll() or server.registration(2), "registration")
        other.register(info(server, 2), "i", [0x10], [8])
        refused = until(lambda: (server.poll(), other.poll())[1], "refusal")[0]
        assert refused.status_code == 400 and server.registration(2).rid == "h"  # the first stays
    finally:
        other.close()


def test_a_missing_other_half_times_out_on_both_sides(pair):
    server, client, clock = pair
    server.expect(3, "p")  # no decode server ever registers 3
    client.register(info(server, 4), "d", [0x10], [8])  # no prefill request ever comes for 4
    until(lambda: server.registration(4) or server.poll().ready, "registration")
    clock.now = 31  # past the prefill side's 30 s, within the decode side's 40 s: the notice ends the room
    assert server.poll().failed == [(3, "no decode server registered room 3 within 30 s")]
    result = until(client.poll, "timeout notice")[0]
    assert (result.room, result.ok, result.status_code) == (4, False, 504)
    assert "received no request for room 4" in result.error
    assert server.rooms == {} and client.num_pending == 0

    # nothing listens there: the refused connection fails the room at once (503), not at its timeout
    client.register(BootstrapInfo("127.0.0.1", 1, 5), "d", [0x10], [8])
    result = until(client.poll, "refused connection")[0]
    assert result.status_code == 503 and "no prefill server's bootstrap server listens at 127.0.0.1:1" in result.error


def test_a_decode_timeout_during_a_write_holds_the_pages_until_the_write_ends(pair):
    """The decode side's own room timeout while the prefill side writes the room: the room is cancelled, not ended,
    so its pages stay held until the prefill side answers (then a 504), or the cancel's grace passes."""
    server, client, clock = pair
    for room in (20, 21):
        server.expect(room, "p")
        client.register(info(server, room), "d", [0x10], [8])
    until(lambda: len(server.poll().ready) == 2 or all(server.registration(r) for r in (20, 21)), "registrations")
    server.take(20)
    server.take(21)  # both being written: the prefill side's own timeout never fires for them
    clock.now = 41  # past the decode side's 40 s
    assert client.poll() == [] and client.num_pending == 2  # cancelled, pages still held
    until(lambda: server.poll() is not None and all(server.rooms[r].cancelled for r in (20, 21)), "cancels")
    server.complete(20, first_token_id=1, first_token_logprob=0.0, nbytes=8, cached_tokens=0)  # the write ended
    result = until(client.poll, "answer after the write")[0]
    assert (result.room, result.ok, result.status_code) == (20, False, 504) and "within 40 s" in result.error
    assert client.num_pending == 1
    clock.now = 46  # no answer for 21 within the grace (5 s): it ends now
    result = until(client.poll, "grace")[0]
    assert (result.room, result.ok, result.status_code) == (21, False, 504) and client.num_pending == 0


def test_failures_and_cancels_end_the_room_on_both_sides(pair):
    server, client, clock = pair
    server.expect(10, "p")
    server.fail(10, "the prefill request was aborted")  # before the decode side registered: told when it does
    client.register(info(server, 10), "d", [0x10], [8])
    result = until(lambda: (server.poll(), client.poll())[1], "failure")[0]
    assert (result.ok, result.status_code, result.error) == (False, 500, "the prefill request was aborted")

    server.expect(11, "p")
    client.register(info(server, 11), "d", [0x10], [8])
    until(lambda: server.poll().ready, "ready room")
    client.cancel(11, "client disconnected")  # not yet being written: the prefill request fails, the room ends
    assert until(lambda: server.poll().failed, "cancel")[0] == (
        11, "the decode server cancelled the request: client disconnected")
    assert until(client.poll, "cancel answer")[0].status_code == 499

    server.expect(12, "p")
    client.register(info(server, 12), "d", [0x10], [8])
    until(lambda: server.poll().ready, "ready room")
    server.take(12)  # being written: the cancel waits for the write's notice
    client.cancel(12, "client disconnected")
    time.sleep(0.05)
    assert server.poll().failed == [] and client.poll() == []
    server.complete(12, 1)
    assert until(client.poll, "result")[0].error == "cancelled"

    client.register(BootstrapInfo("127.0.0.1", 1, 13), "d", [0x10], [8])  # a cancel nobody answers
    client.cancel(13, "aborted")
    clock.now += 5
    assert client.poll()[0].status_code == 499 and client.num_pending == 0


def test_a_prefill_server_that_goes_away_fails_its_rooms_at_once():
    server = BootstrapServer("127.0.0.1", 0)
    client = BootstrapClient("127.0.0.1:5555")
    try:
        client.register(info(server, 20), "d", [0x10], [8])
        until(lambda: server.poll() or server.registration(20), "registration")
        server.close()
        result = until(client.poll, "failure")[0]
        # the monitor sees the drop, or (when its reconnect comes first) the refused reconnect: either fails now
        assert result.status_code == 503 and client.num_pending == 0
        assert "dropped" in result.error or "no prefill server's bootstrap server listens" in result.error
    finally:
        client.close()


def test_malformed_messages_are_refused_and_dropped(pair):
    server, client, _ = pair
    for bad in (b"not json", b"[]", b'{"type": "Pickle"}', encode_message(CompletionNotice(1, ok=True))[:-1],
                b'{"type": "RoomRegistration", "room": -1, "rid": "r", "session_id": "s"}',
                b'{"type": "RoomRegistration", "room": 1, "rid": "r", "session_id": "s", "dst_addrs": [1], '
                b'"lengths": []}',
                b'{"type": "RoomCancel", "room": 1, "extra": 1}'):
        with pytest.raises(MessageError):
            decode_message(bad)
    assert decode_message(encode_message(RoomRegistration(1, "r", "s", [2], [3]))) == RoomRegistration(
        1, "r", "s", [2], [3])
    peer = _Peer(client.ctx, ("127.0.0.1", server.port))
    try:
        peer.sock.send(b'{"type": "RoomCancel", "room": "x"}')
        peer.sock.send(b"\x80\x04 a pickle")
        time.sleep(0.1)
        assert server.poll().failed == [] and server.rooms == {}  # dropped, the server goes on
    finally:
        peer.close()


def test_bootstrap_fields_are_validated_naming_the_field():
    assert BootstrapInfo.parse("10.0.0.1", None, 2**63 - 1).address == ("10.0.0.1", 8998)
    assert BootstrapInfo.parse("[::1]", 9000, 0).host == "::1"
    assert BootstrapInfo.parse("prefill-0.cluster.local", 1, 5).port == 1
    for host, port, room, param in [("a b", 1, 1, "bootstrap_host"), ("h", 0, 1, "bootstrap_port"),
                                    ("h", 65536, 1, "bootstrap_port"), ("h", True, 1, "bootstrap_port"),
                                    ("h", 1, 2**63, "bootstrap_room"), ("h", 1, -1, "bootstrap_room"),
                                    ("h", 1, "5", "bootstrap_room"), ("h", 1, None, "bootstrap_room"),
                                    (None, 1, 5, "bootstrap_host"), (7, 1, 5, "bootstrap_host")]:
        with pytest.raises(MessageError) as e:
            BootstrapInfo.parse(host, port, room)
        assert e.value.param == param


def test_layout_top_logprobs_and_generator_state_travel(pair):
    """The registration carries the decode side's pool layout (kv_state.encode_layout); the notice the first
    token's top logprobs, a seeded generator's state and whether the first token ended the request."""
    from sglang.srt.disaggregation.kv_state import check_same_layout, decode_layout, encode_layout

    server, client, _ = pair
    layout = (16, (("kv.0", 1152), ("index.2", 132)), (("attn.2", 8),))
    client.register(info(server, 30), "d", [0x10], [8], encode_layout(layout))
    server.expect(30, "p")
    reg = until(lambda: server.poll().ready, "ready room")[0]
    check_same_layout(layout, decode_layout(reg.layout))  # the same, after JSON
    with pytest.raises(ValueError, match="pool buffer kv.0 rows are 576 B here, 1152 B on the peer"):
        check_same_layout((16, (("kv.0", 576), ("index.2", 132)), (("attn.2", 8),)), decode_layout(reg.layout))
    with pytest.raises(ValueError, match="sent no pool layout"):
        decode_layout("")
    server.take(30)
    server.complete(30, 42, -0.5, 8, top_logprobs=[[-0.5, 42], [-1.5, 7]], generator_state="00ff", finished=True)
    result = until(client.poll, "result")[0]
    assert (result.first_token_top_logprobs, result.generator_state, result.finished) == (
        [[-0.5, 42], [-1.5, 7]], "00ff", True)
    for field, bad in (("generator_state", "xyz"), ("first_token_top_logprobs", [[1.0]]), ("layout", 5)):
        msg = RoomRegistration(1, "r", "h:1", [1], [1]) if field == "layout" else CompletionNotice(1, True)
        setattr(msg, field, bad)
        with pytest.raises(MessageError) as e:
            decode_message(encode_message(msg))
        assert e.value.param == field


def test_disaggregation_runs_tensor_parallel_but_not_dp_attention():
    from sglang.srt.server_args import ServerArgs

    ServerArgs(model_path="m", disaggregation_mode="prefill", tp_size=2).validate()
    ServerArgs(model_path="m", disaggregation_mode="decode", tp_size=4, nnodes=2, node_rank=1,
               dist_init_addr="10.0.0.1:5000").validate()
    with pytest.raises(ValueError, match="--disaggregation-mode decode runs tensor-parallel attention only: drop "
                                         "--enable-dp-attention"):
        ServerArgs(model_path="m", disaggregation_mode="decode", tp_size=2, dp_size=2,
                   enable_dp_attention=True).validate()
