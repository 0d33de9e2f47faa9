"""What the prefill and decode sides of a disaggregated request tell each other, and the request fields that pair
them (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`, which sglang-router adds in its PD mode).

The messages are dataclasses sent as JSON objects with a "type" key: they cross the network between servers that
share no key, so nothing that could run code when read (pickle) is ever used, and `decode_message` checks every
field's type and range before a message is acted on. A room is the router's random id of one request, shared by
its prefill and decode halves: an integer in [0, 2**63).

decode -> prefill: RoomRegistration (where the request's state goes), RoomCancel (the decode side gave up on it).
prefill -> decode: CompletionNotice (the state has landed with the first token, or why it never will).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import re
from dataclasses import dataclass, field
from typing import Optional

ROOM_LIMIT = 2**63  # rooms are in [0, ROOM_LIMIT), as the router draws them
DEFAULT_BOOTSTRAP_PORT = 8998  # --disaggregation-bootstrap-port's default, as upstream
MAX_MESSAGE_BYTES = 64 * 2**20  # a registration of a long prompt's pages is well under this
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*\.?$")


class MessageError(ValueError):
    """A message or request field that is malformed; `param` names the field."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


def check_room(value, param: str = "bootstrap_room") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < ROOM_LIMIT:
        raise MessageError(f"{param} must be an integer in [0, 2**63), got {value!r}"[:200], param)
    return value


def check_port(value, param: str = "bootstrap_port") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise MessageError(f"{param} must be a port number in [1, 65535], got {value!r}"[:200], param)
    return value


def check_host(value, param: str = "bootstrap_host") -> str:
    """A hostname (RFC 1123) or an IPv4 / IPv6 address (bracketed or not)."""
    if isinstance(value, str):
        bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
        try:
            ipaddress.ip_address(bare)
            return bare
        except ValueError:
            if bare == value and _HOSTNAME.match(value):
                return value
    raise MessageError(f"{param} must be a hostname or an IP address, got {value!r}"[:200], param)


@dataclass(frozen=True)
class BootstrapInfo:
    """The router's pairing of one request: the prefill server's bootstrap address and the request's room. `port`
    None: the router knew none for that prefill server (DEFAULT_BOOTSTRAP_PORT is used)."""

    host: str
    port: Optional[int]
    room: int

    @property
    def address(self) -> tuple:
        return self.host, self.port or DEFAULT_BOOTSTRAP_PORT

    @staticmethod
    def parse(host, port, room) -> "BootstrapInfo":
        """From the request's values (one prompt's); MessageError naming the field when one is malformed."""
        if host is None or room is None:
            missing = "bootstrap_host" if host is None else "bootstrap_room"
            raise MessageError(f"{missing} is missing: bootstrap_host and bootstrap_room come together", missing)
        return BootstrapInfo(check_host(host), None if port is None else check_port(port), check_room(room))


# ---- messages between the two sides ---------------------------------------------------------------------------
@dataclass
class RoomRegistration:
    """decode -> prefill: write request `rid`'s state for `room` into `dst_addrs` (registered memory of transfer
    session `session_id`), `lengths[i]` bytes at each, paired one to one with the prefill side's source regions."""

    room: int
    rid: str
    session_id: str
    dst_addrs: list = field(default_factory=list)
    lengths: list = field(default_factory=list)
    layout: str = ""  # the decode server's pool layout (kv_state.encode_layout): the prefill side checks it matches
    # a decode server of several TP ranks: [session_id, dst_addrs] of its ranks 1.. (the fields above are rank 0's),
    # each rank's addresses paired with the same `lengths` (the ranks hold the request in the same slots)
    rank_destinations: list = field(default_factory=list)

    def destinations(self) -> list:
        """[(session_id, dst_addrs)] of every decode rank, in rank order."""
        return [(self.session_id, self.dst_addrs)] + [(s, a) for s, a in self.rank_destinations]


@dataclass
class RoomCancel:
    """decode -> prefill: the decode side no longer waits for `room` (aborted, timed out); nothing is written."""

    room: int
    reason: str = ""


@dataclass
class CompletionNotice:
    """prefill -> decode: `room`'s state has landed (ok) with the first sampled token, or why it never will."""

    room: int
    ok: bool
    first_token_id: Optional[int] = None
    first_token_logprob: Optional[float] = None
    error: Optional[str] = None
    nbytes: int = 0  # bytes written
    cached_tokens: int = 0  # prompt tokens the prefill side served from its prefix cache
    status_code: int = 200  # for the client when not ok: 4xx a room the prefill side refused, 5xx it failed
    first_token_top_logprobs: Optional[list] = None  # [[logprob, id]] when the request asked for top logprobs
    generator_state: Optional[str] = None  # hex: a seeded request's generator after drawing the first token
    finished: bool = False  # the first token ended the request: nothing was written


MESSAGES = {cls.__name__: cls for cls in (RoomRegistration, RoomCancel, CompletionNotice)}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v) -> bool:
    return isinstance(v, list) and all(_is_int(x) and 0 <= x < 2**64 for x in v)


_CHECKS = {
    "room": lambda v: _is_int(v) and 0 <= v < ROOM_LIMIT,
    "rid": lambda v: isinstance(v, str) and 0 < len(v) <= 512,
    "session_id": lambda v: isinstance(v, str) and 0 < len(v) <= 300,
    "dst_addrs": _int_list,
    "lengths": lambda v: _int_list(v) and all(x > 0 for x in v),
    "reason": lambda v: isinstance(v, str),
    "ok": lambda v: isinstance(v, bool),
    "first_token_id": lambda v: v is None or (_is_int(v) and v >= 0),
    "first_token_logprob": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and not math.isnan(v)),
    "error": lambda v: v is None or isinstance(v, str),
    "nbytes": lambda v: _is_int(v) and v >= 0,
    "cached_tokens": lambda v: _is_int(v) and v >= 0,
    "status_code": lambda v: _is_int(v) and 100 <= v <= 599,
}


def _top_logprobs(v) -> bool:
    return v is None or (isinstance(v, list) and len(v) <= 64 and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], (int, float)) and not isinstance(p[0], bool)
        and _is_int(p[1]) and p[1] >= 0 for p in v))


def _rank_destinations(v) -> bool:
    return isinstance(v, list) and len(v) <= 1024 and all(
        isinstance(d, list) and len(d) == 2 and _CHECKS["session_id"](d[0]) and _int_list(d[1]) for d in v)


_CHECKS.update({
    "layout": lambda v: isinstance(v, str) and len(v) <= 2**20,
    "rank_destinations": _rank_destinations,
    "first_token_top_logprobs": _top_logprobs,
    "generator_state": lambda v: v is None or (isinstance(v, str) and len(v) <= 2**16
                                               and re.fullmatch(r"[0-9a-f]*", v) is not None),
    "finished": lambda v: isinstance(v, bool),
})


def encode_message(msg) -> bytes:
    return json.dumps({"type": type(msg).__name__, **dataclasses.asdict(msg)}, separators=(",", ":")).encode()


def decode_message(data: bytes):
    """The message `data` holds; MessageError when it is not one of MESSAGES with every field well-formed."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"a message of {len(data)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
    try:
        body = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MessageError(f"not a JSON message: {e}") from None
    if not isinstance(body, dict) or body.get("type") not in MESSAGES:
        raise MessageError(f"not one of the messages {sorted(MESSAGES)}")
    cls = MESSAGES[body.pop("type")]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(body) - names
    if unknown:
        raise MessageError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    for name, value in body.items():
        if not _CHECKS[name](value):
            raise MessageError(f"{cls.__name__}.{name} is malformed: {value!r}"[:200], name)
    try:
        msg = cls(**body)
    except TypeError as e:  # a required field missing
        raise MessageError(f"{cls.__name__}: {e}") from None
    if isinstance(msg, RoomRegistration):
        for rank, (_, addrs) in enumerate(msg.destinations()):
            if len(addrs) != len(msg.lengths):
                raise MessageError(f"RoomRegistration pairs {len(addrs)} addresses of decode rank {rank} with "
                                   f"{len(msg.lengths)} lengths", "rank_destinations" if rank else "dst_addrs")
    return msg
