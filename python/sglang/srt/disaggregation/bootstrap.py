"""How a request's prefill and decode halves meet: the prefill server's bootstrap server and the decode server's
client of it, over ZMQ (ROUTER on the prefill side, one DEALER per prefill server on the decode side).

ZMQ rather than HTTP: the completion notice flows back on the connection the decode side opened (the decode server
listens on nothing new), both ends are polled without blocking from the scheduler's loop (which already speaks
ZMQ), and a dropped connection is seen at once through the socket's monitor, so a killed prefill server fails its
rooms without waiting for a timeout. Messages are JSON (messages.py), never pickle.

The protocol, for one room (the router's id of one request, sent to both servers):
1. The decode server pre-allocates the request's pool pages, then `BootstrapClient.register`s the room with the
   prefill server at the request's bootstrap_host:bootstrap_port: its transfer session and the pages' addresses.
2. The prefill server `expect`s the room when the request reaches its scheduler. Once both happened, `poll` lists
   the room as ready; the scheduler `take`s its registration when the prefill ends, writes the state through the
   transfer backend, and calls `complete` (first token id and logprob) or `fail` (why).
3. The decode side's `poll` then returns the room's RoomResult: ok (install the state and decode on), or an error
   with the HTTP status for the client (free the pages).
Every room ends on both sides within `room_timeout_s`: a room registered twice or reused is refused (4xx), one whose
other half never comes fails (5xx), as does every room of a prefill server whose connection drops.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import zmq
import zmq.utils.monitor

from sglang.srt.disaggregation.messages import (MAX_MESSAGE_BYTES, BootstrapInfo, CompletionNotice, MessageError,
                                                RoomCancel, RoomRegistration, decode_message, encode_message)

logger = logging.getLogger(__name__)

DEFAULT_ROOM_TIMEOUT_S = 300.0  # a room's other half must come within this (as --watchdog-timeout's default)
CANCEL_GRACE_S = 10.0  # a cancelled room's pages are held this long for the prefill side's answer
FINISHED_ROOMS_KEPT = 1 << 16  # rooms remembered as used, to refuse their reuse


class RoomError(MessageError):
    """A room this side refuses (reused, already in use); `status_code` for the client."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message, "bootstrap_room")
        self.status_code = status_code


@dataclass
class _PrefillRoom:
    deadline: float
    rid: Optional[str] = None  # the prefill request's, once expected
    registration: Optional[RoomRegistration] = None
    peer: Optional[bytes] = None  # the registering decode server's ZMQ identity
    taken: bool = False  # the scheduler is writing it
    cancelled: Optional[str] = None  # why the decode side cancelled it


@dataclass
class PrefillEvents:
    """What changed since the last poll: rooms now ready to write (their registrations), and expected rooms that
    will never be (room, why): their prefill requests fail."""

    ready: list = field(default_factory=list)
    failed: list = field(default_factory=list)


class _Finished:
    """A bounded memory of rooms that ended, to refuse a room used twice; a room the prefill side failed before the
    decode side registered it keeps its failure, the answer to that registration."""

    def __init__(self, size: int = FINISHED_ROOMS_KEPT) -> None:
        self.rooms: collections.OrderedDict = collections.OrderedDict()
        self.size = size

    def get(self, room: int) -> Optional[CompletionNotice]:
        return self.rooms.get(room)

    def add(self, room: int, failure: Optional[CompletionNotice] = None) -> None:
        self.rooms[room] = failure
        if len(self.rooms) > self.size:
            self.rooms.popitem(last=False)

    def __contains__(self, room: int) -> bool:
        return room in self.rooms


class BootstrapServer:
    """The prefill side: binds --disaggregation-bootstrap-port (0: a free port, see `port`)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, room_timeout_s: float = DEFAULT_ROOM_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a larger frame drops its connection, unread
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a notice to a decode server that left raises, not vanishes
        address = f"tcp://{'[' + host + ']' if ':' in host else host}"
        try:
            self.port = self.sock.bind_to_random_port(address) if port == 0 else port
            if port:
                self.sock.bind(f"{address}:{port}")
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"the bootstrap server cannot bind {host}:{port} ({e}); choose another "
                          f"--disaggregation-bootstrap-port") from None
        self.room_timeout_s = room_timeout_s
        self.clock = clock
        self.rooms: dict = {}  # room -> _PrefillRoom
        self.finished = _Finished()
        self._events = PrefillEvents()

    def expect(self, room: int, rid: str) -> None:
        """The prefill request `rid` of `room` has arrived. RoomError when another request holds the room or it was
        used before."""
        entry = self.rooms.get(room)
        if room in self.finished or (entry is not None and entry.rid is not None):
            raise RoomError(f"bootstrap_room {room} is already used by another request; the router draws a fresh "
                            f"room for each request")
        if entry is None:
            entry = self.rooms[room] = _PrefillRoom(deadline=self.clock() + self.room_timeout_s)
        entry.rid = rid
        if entry.registration is not None:
            self._events.ready.append(entry.registration)

    def poll(self) -> PrefillEvents:
        """Read every waiting message, expire rooms past their deadline; never blocks."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                logger.warning("bootstrap server: dropped a message of %d frame(s)", len(frames))
                continue
            try:
                msg = decode_message(frames[1])
            except MessageError as e:
                logger.warning("bootstrap server: dropped a malformed message: %s", e)
                continue
            if isinstance(msg, RoomRegistration):
                self._on_registration(frames[0], msg)
            elif isinstance(msg, RoomCancel):
                self._on_cancel(msg)
        self._expire()
        events, self._events = self._events, PrefillEvents()
        return events

    def _on_registration(self, peer: bytes, reg: RoomRegistration) -> None:
        entry = self.rooms.get(reg.room)
        if self.finished.get(reg.room) is not None:  # failed here first: tell why
            self._send(peer, self.finished.get(reg.room))
            self.finished.add(reg.room)  # answered once; a further registration is a reuse
            return
        if reg.room in self.finished or (entry is not None and entry.registration is not None):
            self._send(peer, CompletionNotice(reg.room, ok=False, status_code=400, error=(
                f"bootstrap_room {reg.room} is already registered or used by another request; the router draws a "
                f"fresh room for each request")))
            return
        if entry is None:
            entry = self.rooms[reg.room] = _PrefillRoom(deadline=self.clock() + self.room_timeout_s)
        entry.registration, entry.peer = reg, peer
        if entry.rid is not None:
            self._events.ready.append(reg)

    def _on_cancel(self, msg: RoomCancel) -> None:
        entry = self.rooms.get(msg.room)
        if entry is None:
            return
        if entry.taken:  # being written: the notice after the write answers it
            entry.cancelled = msg.reason or "cancelled"
            return
        self._finish(msg.room, CompletionNotice(msg.room, ok=False, status_code=499,
                                                error=f"cancelled by the decode server: {msg.reason}"))
        if entry.rid is not None:
            self._events.failed.append((msg.room, f"the decode server cancelled the request: {msg.reason}"))

    def _expire(self) -> None:
        now = self.clock()
        for room, entry in list(self.rooms.items()):
            if entry.taken or now < entry.deadline:
                continue
            if entry.rid is None:  # registered, but the prefill request never came
                self._finish(room, CompletionNotice(room, ok=False, status_code=504, error=(
                    f"the prefill server received no request for room {room} within {self.room_timeout_s:g} s")))
            else:  # the prefill request came, no decode server registered the room
                self._finish(room, None)
                self._events.failed.append((room, f"no decode server registered room {room} within "
                                                  f"{self.room_timeout_s:g} s"))

    def registration(self, room: int) -> Optional[RoomRegistration]:
        entry = self.rooms.get(room)
        return None if entry is None else entry.registration

    def take(self, room: int) -> RoomRegistration:
        """The registration of a ready room, which the scheduler now writes; it then calls complete or fail."""
        entry = self.rooms.get(room)
        if entry is None or entry.registration is None:
            raise RoomError(f"room {room} has no registration to write to", 500)
        entry.taken = True
        return entry.registration

    def complete(self, room: int, first_token_id: int, first_token_logprob: Optional[float] = None,
                 nbytes: int = 0, cached_tokens: int = 0, top_logprobs: Optional[list] = None,
                 generator_state: Optional[str] = None, finished: bool = False) -> None:
        self._finish(room, CompletionNotice(room, ok=True, first_token_id=first_token_id,
                                            first_token_logprob=first_token_logprob, nbytes=nbytes,
                                            cached_tokens=cached_tokens, first_token_top_logprobs=top_logprobs,
                                            generator_state=generator_state, finished=finished))

    def fail(self, room: int, error: str, status_code: int = 500) -> None:
        """The prefill side gives up on `room` (its request aborted or failed, the write failed): the decode side is
        told, now or when it registers the room."""
        if room not in self.rooms:
            self.rooms[room] = _PrefillRoom(deadline=self.clock() + self.room_timeout_s)
        self._finish(room, CompletionNotice(room, ok=False, status_code=status_code, error=error))

    def _finish(self, room: int, notice: Optional[CompletionNotice]) -> None:
        entry = self.rooms.pop(room, None)
        unsent = notice is not None and not notice.ok and (entry is None or entry.peer is None)
        self.finished.add(room, notice if unsent else None)
        if entry is not None and entry.peer is not None and notice is not None:
            self._send(entry.peer, notice)

    def _send(self, peer: bytes, msg) -> None:
        try:
            self.sock.send_multipart([peer, encode_message(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the decode server left (or is not reading): its own timeout frees the room
            logger.warning("bootstrap server: could not send %s for room %s: %s", type(msg).__name__, msg.room, e)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


# ---- the decode side ------------------------------------------------------------------------------------------
@dataclass
class RoomResult:
    """How a registered room ended, once: ok (the state landed: install it, decode on from first_token_id), or not
    (free its pages; `status_code` and `error` for the client)."""

    room: int
    rid: str
    ok: bool
    first_token_id: Optional[int] = None
    first_token_logprob: Optional[float] = None
    error: Optional[str] = None
    status_code: int = 200
    nbytes: int = 0
    cached_tokens: int = 0
    first_token_top_logprobs: Optional[list] = None
    generator_state: Optional[str] = None
    finished: bool = False  # the first token ended the request on the prefill side: nothing was written


@dataclass
class _DecodeRoom:
    rid: str
    address: tuple
    deadline: float
    cancelled: bool = False
    timed_out: bool = False  # cancelled by this side's room timeout (the result is then a 504, not a 499)


class _Peer:
    """One prefill server's bootstrap connection, with its monitor (to see it drop)."""

    def __init__(self, ctx: zmq.Context, address: tuple) -> None:
        host, port = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self.connected = False
        self.sock.connect(f"tcp://{'[' + host + ']' if ':' in host else host}:{port}")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class BootstrapClient:
    """The decode side: registers rooms with prefill servers and reports how each ended (`poll`). `session_id`:
    this server's transfer session (TransferBackend.session_id), where prefill servers write."""

    def __init__(self, session_id: str, room_timeout_s: float = DEFAULT_ROOM_TIMEOUT_S,
                 cancel_grace_s: float = CANCEL_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.session_id = session_id
        self.room_timeout_s = room_timeout_s
        self.cancel_grace_s = cancel_grace_s
        self.clock = clock
        self.ctx = zmq.Context()
        self.peers: dict = {}  # (host, port) -> _Peer
        self.rooms: dict = {}  # room -> _DecodeRoom
        self._results: list = []

    def register(self, info: BootstrapInfo, rid: str, dst_addrs: list, lengths: list, layout: str = "",
                 rank_destinations: Optional[list] = None) -> None:
        """Ask the prefill server of `info` to write request `rid`'s state to these addresses of this server's
        registered memory (`rank_destinations`: [session_id, dst_addrs] of this server's further TP ranks).
        RoomError when this server already waits on the room."""
        if info.room in self.rooms:
            raise RoomError(f"bootstrap_room {info.room} is already used by a request on this server; the router "
                            f"draws a fresh room for each request")
        address = info.address
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = _Peer(self.ctx, address)
        reg = RoomRegistration(info.room, rid, self.session_id, list(dst_addrs), list(lengths), layout,
                               list(rank_destinations or []))
        self.rooms[info.room] = _DecodeRoom(rid, address, self.clock() + self.room_timeout_s)
        self._send(peer, reg)

    def cancel(self, room: int, reason: str) -> None:
        """Stop waiting for `room` (the request was aborted here). Its result still comes from `poll` (not ok), once
        the prefill side answers or after the grace period: free its pages then, never before, since a write may
        be landing."""
        entry = self.rooms.get(room)
        if entry is None or entry.cancelled:
            return
        entry.cancelled = True
        entry.deadline = min(entry.deadline, self.clock() + self.cancel_grace_s)
        self._send(self.peers[entry.address], RoomCancel(room, reason))

    @property
    def num_pending(self) -> int:
        return len(self.rooms)

    def sockets(self) -> list:
        """The sockets a message or connection event arrives on (to wait on them with the scheduler's input)."""
        return [s for peer in self.peers.values() for s in (peer.sock, peer.monitor)]

    def poll(self) -> list:
        """The rooms that ended since the last poll, as RoomResults; never blocks."""
        for address, peer in list(self.peers.items()):
            self._read_monitor(address, peer)
            while True:
                try:
                    data = peer.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    notice = decode_message(data)
                except MessageError as e:
                    logger.warning("bootstrap client: dropped a malformed message from %s:%s: %s", *address, e)
                    continue
                if isinstance(notice, CompletionNotice):
                    self._on_notice(notice)
        self._expire()
        results, self._results = self._results, []
        return results

    def _read_monitor(self, address: tuple, peer: _Peer) -> None:
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(peer.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                peer.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                peer.connected = False
                self._fail_peer(address, f"the prefill server's bootstrap connection {address[0]}:{address[1]} "
                                         f"dropped (the server stopped or restarted) before room {{room}} was "
                                         f"transferred")
            elif event["event"] == zmq.EVENT_CONNECT_RETRIED and not peer.connected:
                # refused: nothing listens there (a prefill server that died, or a wrong bootstrap port); its
                # rooms fail now instead of at their timeout
                self._fail_peer(address, f"no prefill server's bootstrap server listens at {address[0]}:{address[1]} "
                                         f"(--disaggregation-bootstrap-port) for room {{room}}")

    def _fail_peer(self, address: tuple, error: str) -> None:
        for room, entry in list(self.rooms.items()):
            if entry.address == address:  # a cancelled one stays cancelled (its client left)
                status, why = (504, self._timeout_error(room, entry)) if entry.timed_out else (
                    (499, "cancelled") if entry.cancelled else (503, error.format(room=room)))
                self._end(room, ok=False, status_code=status, error=why)

    def _on_notice(self, notice: CompletionNotice) -> None:
        if notice.room not in self.rooms:
            logger.debug("bootstrap client: a notice for room %s, which no request here waits on", notice.room)
            return
        entry = self.rooms[notice.room]
        if entry.cancelled:
            self._end(notice.room, ok=False, status_code=504 if entry.timed_out else 499,
                      error=self._timeout_error(notice.room, entry) if entry.timed_out else "cancelled",
                      nbytes=notice.nbytes)
            return
        self._end(notice.room, ok=notice.ok, status_code=notice.status_code if not notice.ok else 200,
                  error=notice.error, first_token_id=notice.first_token_id,
                  first_token_logprob=notice.first_token_logprob, nbytes=notice.nbytes,
                  cached_tokens=notice.cached_tokens, first_token_top_logprobs=notice.first_token_top_logprobs,
                  generator_state=notice.generator_state, finished=notice.finished)

    def _expire(self) -> None:
        now = self.clock()
        for room, entry in list(self.rooms.items()):
            if now < entry.deadline:
                continue
            if not entry.cancelled:  # the prefill side may be writing the room right now: cancel it and end the
                # room (freeing its pages) only when the prefill side answers or the cancel's grace has passed
                entry.cancelled = entry.timed_out = True
                entry.deadline = now + self.cancel_grace_s
                self._send(self.peers[entry.address], RoomCancel(room, "timed out on the decode server"))
                continue
            self._end(room, ok=False, status_code=504 if entry.timed_out else 499,
                      error=self._timeout_error(room, entry) if entry.timed_out else "cancelled")

    def _timeout_error(self, room: int, entry: _DecodeRoom) -> str:
        host, port = entry.address
        return f"the prefill server at {host}:{port} did not complete room {room} within {self.room_timeout_s:g} s"

    def _end(self, room: int, **result) -> None:
        entry = self.rooms.pop(room)
        self._results.append(RoomResult(room=room, rid=entry.rid, **result))

    def _send(self, peer: _Peer, msg) -> None:
        try:
            peer.sock.send(encode_message(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # queue full: the room fails now rather than wait out its timeout
            logger.warning("bootstrap client: could not send %s for room %s: %s", type(msg).__name__, msg.room, e)
            if msg.room in self.rooms and isinstance(msg, RoomRegistration):
                self._end(msg.room, ok=False, status_code=503, error=f"the prefill server is not reachable ({e})")

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()
        self.ctx.term()
