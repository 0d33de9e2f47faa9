"""The KV transport of prefill/decode disaggregation (disaggregation/transfer.py): a batch of (source, destination,
length) regions written from one engine's registered torch CPU tensors into another's, in one process
(LocalCopyTransfer) and across two processes over the Mooncake transfer engine's TCP transport and over NIXL (UCX's
TCP transport); many buffers registered in one engine call; a write to a dead or hung peer raising TransferError
within its timeout; a missing engine package named with the flag that needs it; bytes, latency and failures counted
into /metrics. About 6 s (the peer process imports torch)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time

import pytest
import torch

from sglang.srt.disaggregation.transfer import (LocalCopyTransfer, MooncakeTransfer, NixlTransfer, RegisteredBuffer,
                                                TransferError, TransferStats, coalesce, create_transfer_backend,
                                                timed_write)
from sglang.srt.managers.io_struct import SchedulerStats
from sglang.srt.metrics.collector import MetricsCollector


def buffers(tensors: list) -> list:
    return [RegisteredBuffer(f"t{i}", t.data_ptr(), t.numel() * t.element_size()) for i, t in enumerate(tensors)]


def test_coalesce_merges_runs_contiguous_on_both_sides():
    src, dst, lens = coalesce([0, 10, 20, 100], [1000, 1010, 1030, 1040], [10, 10, 5, 5])
    assert (src, dst, lens) == ([0, 20, 100], [1000, 1030, 1040], [20, 5, 5])


def test_local_copy_writes_regions_and_refuses_unregistered_ranges():
    a, b = LocalCopyTransfer(), LocalCopyTransfer()
    src = [torch.arange(64, dtype=torch.uint8), torch.arange(100, 164, dtype=torch.uint8)]
    dst = [torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)]
    a.register(buffers(src))
    b.register(buffers(dst))
    a.write(b.session_id, [src[0].data_ptr() + 8, src[1].data_ptr()], [dst[1].data_ptr(), dst[0].data_ptr() + 32],
            [16, 8])
    assert dst[1][:16].tolist() == list(range(8, 24)) and dst[0][32:40].tolist() == list(range(100, 108))
    assert dst[0][:32].eq(0).all() and dst[1][16:].eq(0).all()
    with pytest.raises(TransferError, match=r"destination \(session local:\d+\) range"):
        a.write(b.session_id, [src[0].data_ptr()], [dst[0].data_ptr() + 60], [8])  # runs past the buffer's end
    with pytest.raises(TransferError, match="source range"):
        a.write(b.session_id, [dst[0].data_ptr()], [dst[0].data_ptr()], [8])
    with pytest.raises(TransferError, match="one to one"):
        a.write(b.session_id, [src[0].data_ptr()], [], [8])
    b.close()
    with pytest.raises(TransferError, match="no transfer session"):
        a.write(b.session_id, [src[0].data_ptr()], [dst[0].data_ptr()], [8])


def _peer(conn, backend: str = "mooncake") -> None:
    """A second process: a transfer engine over one registered 4 KiB tensor; answers with its bytes when asked."""
    engine = create_transfer_backend(backend, "127.0.0.1")
    target = torch.zeros(4096, dtype=torch.uint8)
    engine.register(buffers([target]))
    conn.send((engine.session_id, target.data_ptr(), os.getpid()))
    while conn.recv() == "read":
        conn.send(bytes(target.numpy()))


def stop_and_wait(pid: int) -> None:
    """SIGSTOP, then wait until every thread of pid is stopped: kill() returns before a loaded machine has stopped
    them, and a peer thread still running would answer the write the test expects to hang."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just exited
                pass
        if states and all(s in "tT" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10 s")


def write_pages_out_of_order(engine, pages: list, here, peer_session: str, peer_base: int) -> tuple:
    """Pages 3, 9 and half of 4 into the peer's 4 KiB, out of order, checked through the peer's copy; a source this
    engine did not register refused. Returns the (sources, destinations) written."""
    src = [pages[3].data_ptr(), pages[9].data_ptr(), pages[4].data_ptr() + 128]
    dst = [peer_base + 1024, peer_base, peer_base + 2048]
    engine.write(peer_session, src, dst, [256, 256, 128])
    here.send("read")
    got = here.recv()
    assert got[1024:1280] == bytes([3]) * 256 and got[:256] == bytes([9]) * 256
    assert got[2048:2176] == bytes([4]) * 128 and got[2176:3072] == bytes(3072 - 2176)
    with pytest.raises(TransferError, match="source range"):
        engine.write(peer_session, [peer_base], [peer_base], [8])  # not this engine's memory
    return src, dst


class CountingEngine:
    """Forwards to the Mooncake engine, counting the calls by name."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, {}

    def __getattr__(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        return getattr(self.engine, name)


def test_mooncake_writes_into_another_process_and_fails_fast_on_a_dead_or_hung_peer():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(there,), daemon=True)
    proc.start()
    try:
        peer_session, peer_base, pid = here.recv()
        engine = MooncakeTransfer("127.0.0.1")
        engine._engine = CountingEngine(engine._engine)
        pages = [torch.full((256,), i, dtype=torch.uint8) for i in range(32)]  # 32 "pool pages"
        engine.register(buffers(pages))
        assert engine._engine.calls == {"batch_register_memory": 1}  # one call for every buffer
        src, dst = write_pages_out_of_order(engine, pages, here, peer_session, peer_base)

        stop_and_wait(pid)  # hung: the write gives up after its timeout
        with pytest.raises(TransferError, match="did not complete within"):
            engine.write(peer_session, src[:1], dst[:1], [256], timeout_s=1.0)
        os.kill(pid, signal.SIGKILL)  # dead: its connection is refused at once
        proc.join(10)
        with pytest.raises(TransferError):
            engine.write(peer_session, src[:1], dst[:1], [256], timeout_s=30.0)
        engine.close()
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)


def test_missing_engine_packages_name_the_flag_and_the_package(monkeypatch):
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):  # an import of each raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(TransferError, match=r"--disaggregation-transfer-backend nixl needs .*pip install nixl"):
        NixlTransfer("127.0.0.1")
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(TransferError, match=r"mooncake needs .*pip install mooncake-transfer-engine"):
        create_transfer_backend("mooncake", "127.0.0.1")
    with pytest.raises(TransferError, match="takes mooncake or nixl"):
        create_transfer_backend("rdma")


def test_transfers_are_counted_and_reach_the_metrics():
    a, b = LocalCopyTransfer(), LocalCopyTransfer()
    src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    a.register(buffers([src]))
    b.register(buffers([dst]))
    stats, metrics = TransferStats(), MetricsCollector("m")
    assert timed_write(a, stats, b.session_id, [src.data_ptr()], [dst.data_ptr()], [48]) == 48
    timed_write(a, stats, b.session_id, [src.data_ptr()], [dst.data_ptr()], [16])
    with pytest.raises(TransferError):
        timed_write(a, stats, "local:none", [src.data_ptr()], [dst.data_ptr()], [16])
    metrics.observe_stats(SchedulerStats(0, 0, 0.0, 0, transfer=stats.take()))
    assert stats.latencies == []  # taken with the stats: each write's latency is observed once
    timed_write(a, stats, b.session_id, [src.data_ptr()], [dst.data_ptr()], [8])
    metrics.observe_stats(SchedulerStats(0, 0, 0.0, 0, transfer=stats.take()))
    text = metrics.render().decode()
    assert 'sglang:kv_transfer_bytes_total{model_name="m"} 72.0' in text
    assert 'sglang:kv_transfers_total{model_name="m"} 3.0' in text
    assert 'sglang:kv_transfer_failures_total{model_name="m"} 1.0' in text
    assert 'sglang:kv_transfer_latency_seconds_count{model_name="m"} 3.0' in text


@pytest.mark.parametrize("ucx_tls", [None, "tcp,self"])
def test_nixl_writes_into_another_process_and_fails_on_a_hung_or_dead_peer(monkeypatch, ucx_tls):
    """NIXL over UCX, the transports UCX picks on one host and TCP alone: pages out of order into a peer process, the
    source checked against what was registered, a write to a stopped peer timing out over TCP, to a killed one
    failing as a TransferError."""
    pytest.importorskip("nixl_cu12._api", reason="the test extra installs nixl-cu12")
    if ucx_tls:
        monkeypatch.setenv("UCX_TLS", ucx_tls)  # read by each process's UCX context (the peer inherits it)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(there, "nixl"), daemon=True)
    proc.start()
    try:
        peer_session, peer_base, pid = here.recv()
        engine = create_transfer_backend("nixl", "127.0.0.1")
        assert isinstance(engine, NixlTransfer)
        pages = [torch.full((256,), i, dtype=torch.uint8) for i in range(32)]
        engine.register(buffers(pages))
        src, dst = write_pages_out_of_order(engine, pages, here, peer_session, peer_base)
        engine.write(peer_session, [pages[5].data_ptr()], [peer_base + 3072], [256])  # the peer is known now
        here.send("read")
        assert here.recv()[3072:3328] == bytes([5]) * 256

        # A stopped peer: on one host UCX writes straight into its memory (shared memory / cross-memory attach), so
        # the write lands without it; over UCX's TCP transport it times out (the variant run with UCX_TLS=tcp,self).
        stop_and_wait(pid)
        try:
            engine.write(peer_session, [pages[6].data_ptr()], [peer_base + 3328], [256], timeout_s=2.0)
            landed = True
        except TransferError as e:
            assert "did not complete within 2 s" in str(e)
            landed = False
        assert not (landed and ucx_tls)  # over TCP the stopped peer must receive the bytes itself
        os.kill(pid, signal.SIGCONT)
        if landed:
            here.send("read")
            assert here.recv()[3328:3584] == bytes([6]) * 256
        os.kill(pid, signal.SIGKILL)  # dead: NIXL's disconnect error, as a TransferError
        proc.join(10)
        with pytest.raises(TransferError, match=f"to {peer_session} failed"):
            engine.write(peer_session, src[:1], dst[:1], [256], timeout_s=10.0)
        engine.close()
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
