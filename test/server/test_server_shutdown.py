"""SIGTERM stops the server cleanly: exit status 143, the scheduler process gone, the IPC socket dir removed (uvicorn
re-raises a caught SIGTERM after its graceful shutdown, which used to kill the process before its cleanup ran)."""

from __future__ import annotations

import os
import signal
import time

import httpx

from server_process import launch

MODEL = "tiny-deepseek-v4"


def processes_with(marker: str) -> list:
    """Live processes whose environment holds `marker` (this server's TMPDIR: the server and what it spawned)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours
            pass
    return found


def ipc_dirs(path) -> list:
    return [n for n in os.listdir(path) if n.startswith("sglang-ipc-")]


def test_sigterm_stops_the_scheduler_and_removes_the_ipc_dir(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = f"TMPDIR={tmp}"
    handle = launch(["--model-path", MODEL, "--context-length", "512", "--max-running-requests", "2"],
                    str(tmp_path), env={"TMPDIR": str(tmp)})
    try:
        assert len(ipc_dirs(tmp)) == 1
        assert len(processes_with(marker)) >= 2  # the server and its scheduler
        r = httpx.post(f"{handle.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
        handle.proc.send_signal(signal.SIGTERM)
        assert handle.proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if handle.proc.poll() is None:
            handle.proc.kill()
    assert ipc_dirs(tmp) == []
    deadline = time.time() + 10
    while processes_with(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_with(marker) == []


def test_sigterm_with_requests_running_exits_after_the_grace_period(tmp_path):
    """Running generations get launch_server.GRACEFUL_SHUTDOWN_S to finish, then are cancelled: the server exits
    without waiting for them (these would take tens of seconds more: neither completes), and cleans up as when idle."""
    import json
    import threading

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = f"TMPDIR={tmp}"
    handle = launch(["--model-path", MODEL, "--context-length", "1024", "--max-running-requests", "4"],
                    str(tmp_path), env={"TMPDIR": str(tmp)})
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    completed = []

    def client(stream: bool) -> None:
        try:
            with httpx.stream("POST", f"{handle.base_url}/generate", json={**body, "stream": stream}, timeout=300) as r:
                for line in r.iter_lines():
                    text = line[6:] if line.startswith("data: ") else line
                    if text.startswith("{") and json.loads(text)["meta_info"]["finish_reason"]:
                        completed.append(stream)
        except httpx.HTTPError:
            pass  # the server went away under it

    clients = [threading.Thread(target=client, args=(s,), daemon=True) for s in (True, False)]
    try:
        for c in clients:
            c.start()
        deadline = time.time() + 60
        while (handle.server_info().get("scheduler_stats") or {}).get("num_running_reqs", 0) < 2:
            assert time.time() < deadline, "the requests never ran"
            time.sleep(0.1)
        handle.proc.send_signal(signal.SIGTERM)
        assert handle.proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if handle.proc.poll() is None:
            handle.proc.kill()
    for c in clients:
        c.join(timeout=30)
    assert completed == []
    assert ipc_dirs(tmp) == []
    deadline = time.time() + 10
    while processes_with(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_with(marker) == []
