"""`python -m sglang.launch_server --tp 2 --device cpu`: two scheduler ranks over gloo serve chat requests, /generate
returns the single-rank engine's greedy tokens and prompt logprobs (within 1e-5), and killing a rank stops the
server with exit code 1 and a log line naming the rank, with no scheduler process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx

from server_process import launch

ARGS = ["--model-path", "tiny-deepseek-v4", "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
        "--max-running-requests", "4"]


def _rank_pids(server_pid: int) -> list:
    """The spawned scheduler ranks (children running multiprocessing's spawn_main), in start order."""
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, out):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmd:
            pids.append(pid)
    return sorted(pids)


def test_tp2_server_serves_and_stops_when_a_rank_dies(tmp_path):
    import sglang

    ids = [100, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 11000]
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    eng = sglang.Engine(model_path="tiny-deepseek-v4", device="cpu", dtype="float32", log_level="warning",
                        max_total_tokens=4096, max_running_requests=4)
    try:
        ref = eng.generate(input_ids=ids, sampling_params=sampling, return_logprob=True, logprob_start_len=0)
    finally:
        eng.shutdown()

    server = launch([*ARGS, "--tp", "2"], str(tmp_path), timeout=240)
    try:
        ranks = _rank_pids(server.proc.pid)
        assert len(ranks) == 2, ranks
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-deepseek-v4", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
            "temperature": 0})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 8
        got = httpx.post(f"{server.base_url}/generate", timeout=60, json={
            "input_ids": ids, "sampling_params": sampling, "return_logprob": True, "logprob_start_len": 0}).json()
        assert got["output_ids"] == ref["output_ids"]
        a = [lp for lp, _, _ in got["meta_info"]["input_token_logprobs"][1:]]
        b = [lp for lp, _, _ in ref["meta_info"]["input_token_logprobs"][1:]]
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5

        os.kill(ranks[1], signal.SIGKILL)
        start = time.time()
        code = server.proc.wait(timeout=60)
        assert code == 1, code
        assert time.time() - start < 30
        log = open(server.log_path).read()
        assert "rank 1 (exit code -9)" in log, log[-2000:]
        time.sleep(1)
        assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in ranks), "a rank outlived the server"
    finally:
        if server.proc.poll() is None:
            server.stop()


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    except OSError:
        return True
