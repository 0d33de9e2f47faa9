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
