"""Start a real `python -m sglang.launch_server` process on loopback for tests."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


# Ports a test hands to a server it starts come from a block of this test process's own, below the kernel's
# ephemeral range (32768 and up): between the pick and the server's bind, the kernel never gives the port to an
# outgoing connection or a bind(0), and the other pytest-xdist worker (PYTEST_XDIST_WORKER=gwN) picks from another
# block. The start within the block is random, so test runs side by side on one machine rarely try the same port.
PORT_BLOCK_BASE, PORT_BLOCK_SIZE, PORT_BLOCKS = 20000, 1000, 12
_next_offset = random.randrange(PORT_BLOCK_SIZE)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A loopback port p, with p + 1 .. p + span - 1 also free (a --dist-init-addr's port + 1 answers DP groups);
    the next pick starts past the span, so a server started later never takes a port a span holds."""
    global _next_offset
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    block = PORT_BLOCK_BASE + PORT_BLOCK_SIZE * (int(worker.removeprefix("gw") or 0) % PORT_BLOCKS)
    for _ in range(PORT_BLOCK_SIZE):
        offset = _next_offset % PORT_BLOCK_SIZE
        if offset + span > PORT_BLOCK_SIZE:  # the span would leave the block: start again at its beginning
            offset = 0
        _next_offset = offset + span
        if all(_port_free(block + offset + i) for i in range(span)):
            return block + offset
    raise RuntimeError(f"no free port in {block}..{block + PORT_BLOCK_SIZE - 1}")


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@dataclass
class ServerHandle:
    base_url: str
    proc: subprocess.Popen
    startup_s: float
    log_path: str

    def stop(self) -> None:
        stop_process(self.proc)

    def server_info(self, headers=None) -> dict:
        return httpx.get(f"{self.base_url}/server_info", headers=headers, timeout=10).json()

    def wait_pools_free(self, headers=None, timeout: float = 20.0) -> dict:
        """Poll until the scheduler reports no running/waiting request and every pool slot free."""
        deadline = time.time() + timeout
        stats = None
        while time.time() < deadline:
            stats = self.server_info(headers).get("scheduler_stats")
            if stats and stats["pools_all_free"] and not stats["num_running_reqs"] and not stats["num_waiting_reqs"]:
                return stats
            time.sleep(0.2)
        raise AssertionError(f"pools not free after {timeout} s: {stats}")


def launch(args: list, tmp_dir: str, timeout: float = 120.0, env: dict = None) -> ServerHandle:
    """The server with `args` (env: variables added to this process's), healthy; its log under tmp_dir."""
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *args]
    start = time.perf_counter()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return ServerHandle(base, proc, time.perf_counter() - start, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not healthy after {timeout} s:\n{open(log_path).read()[-4000:]}")


@dataclass
class RouterHandle:
    base_url: str
    proc: subprocess.Popen
    log_path: str

    def stop(self) -> None:
        stop_process(self.proc)


def _router(cmd: list, log_path: str, ready, timeout: float, what: str) -> RouterHandle:
    """Start the router command; return once ready(base_url) holds (HTTP errors count as not yet)."""
    port = free_port()
    cmd = [*cmd, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()), "--log-level",
           "warn"]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    base, start = f"http://127.0.0.1:{port}", time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if ready(base):
                return RouterHandle(base, proc, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} not ready after {timeout} s:\n{open(log_path).read()[-4000:]}")


def launch_router(worker_urls: list, args: list, tmp_dir: str, timeout: float = 60.0) -> RouterHandle:
    """sglang-router (`python -m sglang_router.launch_router`, regular mode) over `worker_urls`, every worker
    registered and healthy; its own Prometheus port is a free one (the default 29000 may be taken)."""

    def ready(base: str) -> bool:
        r = httpx.get(f"{base}/readiness", timeout=1)
        return r.status_code == 200 and r.json().get("healthy_workers") == len(worker_urls)

    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, *args]
    return _router(cmd, os.path.join(tmp_dir, f"router-{free_port()}.log"), ready, timeout, "router")


def launch_pd_router(prefill_url: str, bootstrap_port: int, decode_url: str, tmp_dir: str,
                     timeout: float = 60.0) -> RouterHandle:
    """sglang-router in its PD mode over one prefill and one decode server, once a one-token /generate through it
    answers 200 (the decode side has reached the prefill side's bootstrap server by then)."""

    def ready(base: str) -> bool:
        return httpx.post(f"{base}/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}},
                          timeout=30).status_code == 200

    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill_url,
           str(bootstrap_port), "--decode", decode_url]
    return _router(cmd, os.path.join(tmp_dir, f"pd-router-{free_port()}.log"), ready, timeout, "the PD router")
