"""Who may call what over HTTP: the API key, the admin endpoints (admin key, else loopback clients only), the owner of
a stored response, and which checkpoints /update_weights_from_disk may load.

* `--api-key KEY`: every endpoint but /health needs `Authorization: Bearer KEY` (the admin key is taken too).
* Admin endpoints (ADMIN_PATHS, and /abort_request with abort_all) change or expose server state: weights, the
  prefix cache, profiles and expert records written to disk, every client's requests. With `--admin-api-key` they
  need that key (401 without an Authorization header, 403 with another key: --api-key does not grant admin). Without
  it they are served to local tools only (403 otherwise), so local use and tests keep working and a server bound
  beyond localhost is not administered by whoever reaches it. A local tool is a loopback client (the TCP peer, or
  what a reverse proxy on loopback says in X-Forwarded-For: uvicorn trusts 127.0.0.1's) that addresses the server
  by a loopback name (Host: localhost, 127.0.0.1, [::1]) and is not a web page: a page another site served may make
  the browser send requests to localhost (Origin, Sec-Fetch-Site cross-site / same-site), and DNS rebinding sends
  them with the attacker's name as Host. Behind a local proxy that sets neither X-Forwarded-For nor a loopback Host,
  set --admin-api-key.
* A stored response belongs to a hash of the key its request was authorized with; with --api-key, another key reads,
  continues, cancels or deletes it as if it did not exist (404, so ids cannot be probed). Without --api-key every
  response is everyone's.

Keys are compared in constant time (hmac.compare_digest), so timing does not reveal how much of a guess is right.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

from sglang.srt.managers.tokenizer_manager import RequestError

ADMIN_PATHS = frozenset({
    "/update_weights_from_disk", "/get_weights_by_name", "/flush_cache", "/clear_hicache_storage_backend",
    "/start_profile", "/stop_profile",
    "/start_expert_distribution_record", "/stop_expert_distribution_record", "/dump_expert_distribution_record"})


def is_loopback(host: Optional[str]) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped loopback; anything that is not an IP address (a unix socket peer, a test
    client's name) is not."""
    try:
        ip = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _header(scope, name: bytes) -> bytes:
    """The first `name` header's bytes as received (b"" without one)."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return b""


def _authorization(scope) -> bytes:
    return _header(scope, b"authorization")


def _is_loopback_name(host: str) -> bool:
    """A Host / Origin host that names this machine's loopback: localhost, *.localhost, a loopback address."""
    host = host.lower().rstrip(".")
    return host == "localhost" or host.endswith(".localhost") or is_loopback(host.strip("[]"))


def _hostname(url: str) -> str:
    """The host part of a URL ('' when there is none, or the URL does not parse: '[::1' has no end)."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


def _not_a_local_tool(scope) -> Optional[str]:
    """Why a loopback client's request is not from a local tool (see the module's docstring), or None."""
    host = _hostname("//" + _header(scope, b"host").decode("latin-1"))
    if not _is_loopback_name(host):
        return f"it names the server as {host!r}, not a loopback name"
    if _header(scope, b"sec-fetch-site") in (b"cross-site", b"same-site"):
        return "a web page sent it"
    origin = _header(scope, b"origin").decode("latin-1")
    if origin and not _is_loopback_name(_hostname(origin)):
        return f"a web page of {origin} sent it"
    return None


def _is_key(sent: bytes, key: Optional[str]) -> bool:
    return bool(key) and hmac.compare_digest(sent, f"Bearer {key}".encode("utf-8"))


@dataclass(frozen=True)
class AccessPolicy:
    """The server's keys and the checkpoint directories /update_weights_from_disk may load (from ServerArgs)."""

    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    model_path: str = ""  # the served --model-path as given: reloading it is always allowed
    weights_dir: Optional[str] = None  # None: the served checkpoint's parent directory
    allow_hub_weight_updates: bool = False

    @staticmethod
    def from_args(args) -> "AccessPolicy":
        return AccessPolicy(args.api_key, args.admin_api_key, args.model_path, args.weights_dir,
                            args.allow_hub_weight_updates)

    def refusal(self, scope) -> Optional[RequestError]:
        """Why the HTTP request `scope` may not reach its endpoint (401 / 403), or None."""
        if scope["path"] in ADMIN_PATHS:
            return self.admin_refusal(scope)
        if not self.api_key or scope["path"] == "/health":
            return None
        sent = _authorization(scope)
        api, admin = _is_key(sent, self.api_key), _is_key(sent, self.admin_api_key)  # both: no timing difference
        if api or admin:
            return None
        return RequestError("missing or invalid API key (send 'Authorization: Bearer <key>')", 401)

    def admin_refusal(self, scope) -> Optional[RequestError]:
        """Why `scope` may not use an admin endpoint, or None (see the module's docstring)."""
        sent = _authorization(scope)
        if self.admin_api_key:
            if not sent:
                return RequestError("this is an admin endpoint: send 'Authorization: Bearer <admin key>' (the key "
                                    "the server was started with as --admin-api-key)", 401)
            if not _is_key(sent, self.admin_api_key):
                return RequestError("the key sent is not the admin key: admin endpoints take only the "
                                    "--admin-api-key key", 403)
            return None
        client = scope.get("client")
        if not is_loopback(client[0] if client else None):
            return RequestError("admin endpoints are served to loopback clients only; start the server with "
                                "--admin-api-key KEY to administer it remotely", 403)
        why = _not_a_local_tool(scope)
        if why is not None:
            return RequestError(f"admin endpoints are served to local tools only without --admin-api-key, and {why}",
                                403)
        if self.api_key and not _is_key(sent, self.api_key):
            return RequestError("missing or invalid API key (send 'Authorization: Bearer <key>')", 401)
        return None

    def require_admin(self, scope) -> None:
        """For an endpoint whose body decides whether it is an admin action (/abort_request with abort_all)."""
        refusal = self.admin_refusal(scope)
        if refusal is not None:
            raise refusal

    def owner(self, scope) -> Optional[str]:
        """Who owns the responses a request stores: a hash of the key it was authorized with (the guard checked
        it); None without --api-key."""
        if not self.api_key:
            return None
        return hashlib.sha256(_authorization(scope)).hexdigest()

    def checkpoint_path(self, model_path: str, served_dir: str) -> str:
        """The checkpoint an /update_weights_from_disk request may load: the served --model-path as given, a
        directory under --weights-dir (symlinks and '..' resolved; default: `served_dir`'s parent, served_dir
        being the served checkpoint's local directory), or a hub id with --allow-hub-weight-updates. Returns what
        to load; RequestError (400) naming model_path otherwise."""
        if model_path == self.model_path:
            return model_path
        if "\0" in model_path:
            raise RequestError("model_path must not contain a NUL character", param="model_path")
        if os.path.isabs(model_path) or model_path.startswith(".") or os.path.exists(model_path):
            root = os.path.realpath(self.weights_dir or os.path.dirname(os.path.realpath(served_dir)))
            real = os.path.realpath(model_path)
            if os.path.commonpath([root, real]) != root:
                raise RequestError(f"model_path {model_path!r} is outside the weights directory {root} "
                                   "(--weights-dir): only checkpoints under it can be loaded", param="model_path")
            return real
        if not self.allow_hub_weight_updates:
            raise RequestError(f"model_path {model_path!r} is not a directory and hub ids are not loaded by this "
                               "server (start it with --allow-hub-weight-updates to allow them)", param="model_path")
        return model_path
