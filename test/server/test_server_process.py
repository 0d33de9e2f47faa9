"""The test servers' port picking (server_process.free_port): each pytest-xdist worker takes ports from its own
block below the kernel's ephemeral range, free when picked, with the span a --dist-init-addr needs."""

import socket

from server_process import PORT_BLOCK_BASE, PORT_BLOCK_SIZE, PORT_BLOCKS, free_port


def test_workers_pick_from_their_own_blocks_below_the_ephemeral_range(monkeypatch):
    for worker, index in (("gw0", 0), ("gw1", 1), ("gw3", 3)):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        block = PORT_BLOCK_BASE + PORT_BLOCK_SIZE * index
        ports = {free_port() for _ in range(20)}
        assert all(block <= p < block + PORT_BLOCK_SIZE for p in ports), (worker, ports)
        assert len(ports) == 20  # successive picks move on: a server still starting keeps its port
    assert PORT_BLOCK_BASE + PORT_BLOCK_SIZE * PORT_BLOCKS <= 32768  # Linux's default ephemeral range starts there


def test_a_port_in_use_is_skipped_and_the_span_is_free(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    held = []
    try:
        for _ in range(30):  # hold 30 picks: none is handed out again while held
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            held.append(s)
        port = free_port(span=2)
        assert port not in {s.getsockname()[1] for s in held}
        for p in (port, port + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
        # nothing binds the span before the server taking it starts: the next pick is past it all the same
        assert free_port() not in (port, port + 1)
    finally:
        for s in held:
            s.close()
