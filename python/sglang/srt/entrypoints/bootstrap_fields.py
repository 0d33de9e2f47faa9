"""The request fields of prefill/decode disaggregation that sglang-router adds in its PD mode (`bootstrap_host`,
`bootstrap_port`, `bootstrap_room`), checked and matched to the requests a body makes.

One room per request the scheduler serves: a single prompt takes scalars; a batch (several prompts, or `n` > 1)
takes a list of rooms, one per prompt or choice, with the host and port either lists of the same length or one
value for all, as the router sends them. A malformed value is a 400 naming the field, whatever the server's mode.
A server in --disaggregation-mode null ignores well-formed fields, as upstream does (a router in PD mode sent the
request to the wrong server, and serving it whole is the useful answer); one in prefill or decode mode refuses a
request without them (it cannot be served alone, and would otherwise wait out the room timeout).
"""

from __future__ import annotations

from typing import Optional

from starlette.requests import Request

from sglang.srt.disaggregation.messages import BootstrapInfo, MessageError
from sglang.srt.managers.tokenizer_manager import RequestError


def _per_request(name: str, value, count: int, unit: str, broadcast: bool) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries for {count} {unit}(s): give one per {unit}",
                               param=name)
        return value
    if count != 1 and not broadcast:
        raise RequestError(f"{name} must be a list of {count} rooms, one per {unit}: each request needs its own room",
                           param=name)
    return [value] * count


def bootstrap_infos(req, raw: Request, count: int, unit: str = "prompt") -> list:
    """One Optional[BootstrapInfo] per request the body makes (`count` of them), in order; None where the request
    is served whole on this server. RequestError (400) for a malformed or missing field."""
    mode = getattr(raw.app.state, "disaggregation_mode", "null")
    host, port, room = req.bootstrap_host, req.bootstrap_port, req.bootstrap_room
    if host is None and port is None and room is None:
        if mode != "null":
            raise RequestError(f"this server runs --disaggregation-mode {mode}: requests reach it through "
                               f"sglang-router in PD mode, which adds bootstrap_host, bootstrap_port and "
                               f"bootstrap_room", param="bootstrap_room")
        return [None] * count
    rooms = _per_request("bootstrap_room", room, count, unit, broadcast=False)
    hosts = _per_request("bootstrap_host", host, count, unit, broadcast=True)
    ports = _per_request("bootstrap_port", port, count, unit, broadcast=True)
    try:
        infos = [BootstrapInfo.parse(h, p, r) for h, p, r in zip(hosts, ports, rooms)]
    except MessageError as e:
        raise RequestError(str(e), param=e.param) from None
    if len({i.room for i in infos}) != count:
        raise RequestError("bootstrap_room holds the same room twice: each request needs its own room",
                           param="bootstrap_room")
    return [None] * count if mode == "null" else infos


def refuse_in_pd_mode(raw: Request, endpoint: str) -> None:
    """Endpoints the router does not pair (no rooms): a 400 on a prefill or decode server, not a wait."""
    mode: Optional[str] = getattr(raw.app.state, "disaggregation_mode", "null")
    if mode != "null":
        raise RequestError(f"{endpoint} is not served with --disaggregation-mode {mode}; use /v1/chat/completions, "
                           f"/v1/completions or /generate through sglang-router")
