"""Moving bytes from this process's registered memory into a peer's: the TransferBackend protocol and its engines.

A backend registers the buffers that may travel once (`register`), names itself to peers by `session_id`, and
`write`s a batch of (source address, destination address, length) triples into a peer's registered memory,
returning once every byte has landed or raising TransferError. Implementations:

* MooncakeTransfer: the Mooncake transfer engine (PyPI mooncake-transfer-engine; the -non-cuda wheel on machines
  without CUDA), TCP by default, RDMA on the devices given to --disaggregation-ib-device. Peers find each other
  peer-to-peer ("P2PHANDSHAKE"): a session id is host:rpc_port, no metadata server.
* NixlTransfer: NVIDIA's NIXL over UCX (PyPI nixl, or one of its builds alone: nixl-cu12, nixl-cu13), host or
  device memory; UCX's TCP transport serves machines without RDMA or a GPU.
* LocalCopyTransfer: both sides in one process (memmove), for in-process tests and a one-process setup.

Every write is bounded in time: a peer that died fails at once (its connection is refused or reset), one that hangs
fails after `timeout_s`.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

logger = logging.getLogger(__name__)

DEFAULT_WRITE_TIMEOUT_S = 60.0  # one batch; a hung peer's write fails after this


class TransferError(RuntimeError):
    """A write that did not complete (peer gone or unreachable, address not registered, timed out), or a backend
    that cannot start."""


@dataclass(frozen=True)
class RegisteredBuffer:
    """A span of memory that may travel (a pool buffer), registered once with the transfer engine."""

    name: str
    data_ptr: int
    nbytes: int
    device: str = "cpu"  # "cuda": device memory, registered as such (no host staging)


class TransferBackend(Protocol):
    session_id: str  # how peers address this engine ("host:port")

    def register(self, buffers: Sequence[RegisteredBuffer]) -> None: ...

    def write(self, peer_session: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int], timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None: ...

    def close(self) -> None: ...


@dataclass
class TransferStats:
    """One server's transfers since start (the /metrics counters follow it); `latencies`: the seconds of each write
    since the stats were last taken (`take`), for the latency histogram."""

    num_transfers: int = 0
    num_failures: int = 0
    bytes: int = 0
    latencies: list = field(default_factory=list)

    def take(self) -> "TransferStats":
        """A copy to send with the scheduler's stats; the latencies go with it."""
        snapshot = TransferStats(self.num_transfers, self.num_failures, self.bytes, self.latencies)
        self.latencies = []
        return snapshot


@dataclass
class TransferQueues:
    """This server's requests at each stage of their transfer (the queue-depth gauges). Prefill: `waiting`, exported
    and waiting for the decode server's registration of their room; `transferring`, writes in flight. Decode:
    `waiting`, queued for pool pages; `transferring`, pages held, waiting for their bytes."""

    role: str  # "prefill" or "decode"
    waiting: int = 0
    transferring: int = 0


def timed_write(backend: "TransferBackend", stats: TransferStats, peer_session: str, src_addrs: Sequence[int],
                dst_addrs: Sequence[int], lengths: Sequence[int], timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> int:
    """backend.write, counted in `stats` (bytes and latency of a write that landed, or a failure); returns the
    bytes written."""
    start = time.perf_counter()
    try:
        backend.write(peer_session, src_addrs, dst_addrs, lengths, timeout_s)
    except TransferError:
        stats.num_failures += 1
        raise
    nbytes = sum(lengths)
    stats.num_transfers += 1
    stats.bytes += nbytes
    stats.latencies.append(time.perf_counter() - start)
    return nbytes


def check_batch(src_addrs: Sequence[int], dst_addrs: Sequence[int], lengths: Sequence[int]) -> None:
    if not len(src_addrs) == len(dst_addrs) == len(lengths):
        raise TransferError(f"a write pairs sources, destinations and lengths one to one; got {len(src_addrs)}, "
                            f"{len(dst_addrs)} and {len(lengths)}")
    if any(n <= 0 for n in lengths):
        raise TransferError("every length of a write must be positive")


def coalesce(src_addrs: Sequence[int], dst_addrs: Sequence[int], lengths: Sequence[int]) -> tuple:
    """The same batch with runs that are contiguous on both sides merged (consecutive pages of one buffer travel as
    one entry): (src_addrs, dst_addrs, lengths) lists."""
    src, dst, lens = [], [], []
    for s, d, n in zip(src_addrs, dst_addrs, lengths):
        if lens and src[-1] + lens[-1] == s and dst[-1] + lens[-1] == d:
            lens[-1] += n
        else:
            src.append(s)
            dst.append(d)
            lens.append(n)
    return src, dst, lens


class _Spans:
    """Registered memory of one engine, to refuse an address outside it before the engine dereferences it."""

    def __init__(self) -> None:
        self.starts: list = []
        self.ends: list = []

    def add(self, buffers: Sequence[RegisteredBuffer]) -> None:
        for b in buffers:
            if b.nbytes <= 0:
                raise TransferError(f"buffer {b.name!r} is empty: nothing to register")
            i = bisect.bisect(self.starts, b.data_ptr)
            self.starts.insert(i, b.data_ptr)
            self.ends.insert(i, b.data_ptr + b.nbytes)

    def check(self, addrs: Sequence[int], lengths: Sequence[int], side: str) -> None:
        for addr, n in zip(addrs, lengths):
            i = bisect.bisect(self.starts, addr) - 1
            if i < 0 or addr + n > self.ends[i]:
                raise TransferError(f"{side} range [{addr:#x}, {addr + n:#x}) is outside the registered buffers")


def run_bounded(fn: Callable[[], None], timeout_s: float, what: str) -> None:
    """fn() in a daemon thread, waited for at most timeout_s: an engine call stuck on a hung peer fails the write
    instead of the caller (the thread is left to the engine's own timeout, and never blocks process exit)."""
    box: list = []

    def run():
        try:
            fn()
            box.append(None)
        except BaseException as e:  # handed to the caller
            box.append(e)

    worker = threading.Thread(target=run, name="kv-transfer", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TransferError(f"{what} did not complete within {timeout_s:g} s (is the peer alive?)")
    if box[0] is not None:
        raise box[0]


class LocalCopyTransfer:
    """Both sides in one process: a write is a memmove between two instances' registered buffers."""

    _sessions: dict = {}  # session id -> instance, within this process
    _ids = itertools.count()

    def __init__(self) -> None:
        self.session_id = f"local:{next(self._ids)}"
        self._spans = _Spans()
        self._sessions[self.session_id] = self

    def register(self, buffers: Sequence[RegisteredBuffer]) -> None:
        self._spans.add(buffers)

    def write(self, peer_session: str, src_addrs, dst_addrs, lengths, timeout_s: float = DEFAULT_WRITE_TIMEOUT_S):
        check_batch(src_addrs, dst_addrs, lengths)
        peer = self._sessions.get(peer_session)
        if peer is None:
            raise TransferError(f"no transfer session {peer_session!r} in this process (closed, or never opened)")
        self._spans.check(src_addrs, lengths, "source")
        peer._spans.check(dst_addrs, lengths, f"destination (session {peer_session})")
        for s, d, n in zip(src_addrs, dst_addrs, lengths):
            ctypes.memmove(d, s, n)

    def close(self) -> None:
        self._sessions.pop(self.session_id, None)


def _session_host(hostname: str) -> str:
    return f"[{hostname}]" if ":" in hostname else hostname  # an IPv6 address


class MooncakeTransfer:
    """The Mooncake transfer engine. `hostname`: the address peers reach this one at (this host's, not 0.0.0.0);
    `ib_devices`: --disaggregation-ib-device (comma-separated RDMA NICs, e.g. mlx5_0,mlx5_1): RDMA on them, else
    TCP."""

    def __init__(self, hostname: Optional[str] = None, ib_devices: Optional[str] = None) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransferError(
                f"--disaggregation-transfer-backend mooncake needs the Mooncake transfer engine: pip install "
                f"mooncake-transfer-engine (mooncake-transfer-engine-non-cuda on a machine without CUDA; it loads "
                f"libibverbs.so.1 and libnuma.so.1: apt-get install libibverbs1 libnuma1) ({e})") from None
        self.hostname = hostname or socket.gethostbyname(socket.gethostname())
        self.protocol = "rdma" if ib_devices else "tcp"
        self._engine = TransferEngine()
        rc = self._engine.initialize(self.hostname, "P2PHANDSHAKE", self.protocol, ib_devices or "")
        if rc != 0:
            raise TransferError(f"the Mooncake transfer engine did not start on {self.hostname} over "
                                f"{self.protocol} (devices {ib_devices!r}): code {rc}")
        self.session_id = f"{_session_host(self.hostname)}:{self._engine.get_rpc_port()}"
        self._spans = _Spans()
        self._registered: list = []

    def register(self, buffers: Sequence[RegisteredBuffer]) -> None:
        """One engine call for all of them (a pool has dozens of buffers: one per layer and kind)."""
        buffers = list(buffers)
        if not buffers:
            return
        self._spans.add(buffers)
        rc = self._engine.batch_register_memory([b.data_ptr for b in buffers], [b.nbytes for b in buffers])
        if rc != 0:
            raise TransferError(f"registering {len(buffers)} buffer(s) with the Mooncake engine failed: code {rc}")
        self._registered += [b.data_ptr for b in buffers]

    def write(self, peer_session: str, src_addrs, dst_addrs, lengths, timeout_s: float = DEFAULT_WRITE_TIMEOUT_S):
        check_batch(src_addrs, dst_addrs, lengths)
        self._spans.check(src_addrs, lengths, "source")
        src, dst, lens = coalesce(src_addrs, dst_addrs, lengths)
        codes = []
        run_bounded(lambda: codes.append(self._engine.batch_transfer_sync_write(peer_session, src, dst, lens)),
                    timeout_s, f"a write of {sum(lens)} bytes to {peer_session}")
        if codes[0] != 0:
            raise TransferError(f"the write of {sum(lens)} bytes in {len(lens)} span(s) to {peer_session} failed "
                                f"(code {codes[0]}): the peer is gone, unreachable, or the addresses are not its "
                                f"registered memory")

    def close(self) -> None:
        if self._registered:
            self._engine.batch_unregister_memory(self._registered)
            self._registered = []


class NixlTransfer:
    """NVIDIA NIXL (UCX). Peers fetch each other's metadata from NIXL's own listener: a session id is host:port of
    that listener, which is also the agent's name."""

    def __init__(self, hostname: Optional[str] = None, listen_port: int = 0, backends: tuple = ("UCX",)) -> None:
        nixl_agent, nixl_agent_config = _nixl_api()
        self.hostname = hostname or socket.gethostbyname(socket.gethostname())
        port = listen_port or _free_port()
        self.session_id = f"{_session_host(self.hostname)}:{port}"
        config = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=True, listen_port=port,
                                   backends=list(backends))
        self._agent = nixl_agent(self.session_id, config)
        self._spans = _Spans()
        self._peers: set = set()
        self._descs = []
        self._kind = "DRAM"

    def register(self, buffers: Sequence[RegisteredBuffer]) -> None:
        buffers = list(buffers)
        if not buffers:
            return
        self._spans.add(buffers)
        self._kind = "VRAM" if any(b.device != "cpu" for b in buffers) else "DRAM"
        self._descs.append(self._agent.register_memory([(b.data_ptr, b.nbytes, 0, "") for b in buffers],
                                                       self._kind))

    def _connect(self, peer_session: str, deadline: float) -> None:
        if peer_session in self._peers:
            return
        host, _, port = peer_session.rpartition(":")
        self._agent.fetch_remote_metadata(peer_session, host.strip("[]"), int(port))
        while not self._agent.check_remote_metadata(peer_session):
            if time.monotonic() > deadline:
                raise TransferError(f"no NIXL metadata from {peer_session} (is the peer alive?)")
            time.sleep(0.001)
        self._peers.add(peer_session)

    def write(self, peer_session: str, src_addrs, dst_addrs, lengths, timeout_s: float = DEFAULT_WRITE_TIMEOUT_S):
        check_batch(src_addrs, dst_addrs, lengths)
        self._spans.check(src_addrs, lengths, "source")
        deadline = time.monotonic() + timeout_s
        src, dst, lens = coalesce(src_addrs, dst_addrs, lengths)
        try:
            self._connect(peer_session, deadline)
            self._write(peer_session, src, dst, lens, deadline, timeout_s)
        except TransferError:
            raise
        except Exception as e:  # NIXL's own errors (e.g. nixlRemoteDisconnectError: the peer is gone)
            self._peers.discard(peer_session)  # its metadata is fetched again should it come back
            raise TransferError(f"the NIXL write of {sum(lens)} bytes to {peer_session} failed: "
                                f"{type(e).__name__}: {e}") from None

    def _write(self, peer_session: str, src: list, dst: list, lens: list, deadline: float, timeout_s: float) -> None:
        local = self._agent.get_xfer_descs([(a, n, 0) for a, n in zip(src, lens)], self._kind)
        remote = self._agent.get_xfer_descs([(a, n, 0) for a, n in zip(dst, lens)], self._kind)
        handle = self._agent.initialize_xfer("WRITE", local, remote, peer_session)
        try:
            state = self._agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TransferError(f"a NIXL write to {peer_session} did not complete within {timeout_s:g} s")
                time.sleep(0.0002)
                state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError(f"the NIXL write of {sum(lens)} bytes to {peer_session} failed")
        finally:
            try:  # a write still in flight (timed out) is cancelled here, if the backend can
                self._agent.release_xfer_handle(handle)
            except Exception as e:
                logger.warning("releasing a NIXL write to %s: %s: %s", peer_session, type(e).__name__, e)

    def close(self) -> None:
        for descs in self._descs:
            self._agent.deregister_memory(descs)
        self._descs = []


NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")  # the meta package, then its builds alone


def _nixl_api() -> tuple:
    """(nixl_agent, nixl_agent_config) from the first NIXL module that imports: the `nixl` meta package picks its
    build by the CUDA it finds; a build installed alone (nixl-cu12 on a machine without CUDA) is imported as such."""
    import importlib

    errors = []
    for name in NIXL_MODULES:
        try:
            api = importlib.import_module(name)
            return api.nixl_agent, api.nixl_agent_config
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise TransferError(f"--disaggregation-transfer-backend nixl needs NVIDIA's NIXL: pip install nixl (or "
                        f"nixl-cu12 / nixl-cu13 alone); or use --disaggregation-transfer-backend mooncake "
                        f"({'; '.join(errors)})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def create_transfer_backend(name: str, hostname: Optional[str] = None,
                            ib_devices: Optional[str] = None) -> TransferBackend:
    """The engine --disaggregation-transfer-backend names: mooncake, nixl, or local (one process)."""
    if name == "mooncake":
        return MooncakeTransfer(hostname, ib_devices)
    if name == "nixl":
        return NixlTransfer(hostname)
    if name == "local":
        return LocalCopyTransfer()
    raise TransferError(f"unknown transfer backend {name!r}; --disaggregation-transfer-backend takes mooncake or "
                        f"nixl")
