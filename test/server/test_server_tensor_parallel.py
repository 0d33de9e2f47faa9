"""`python -m sglang.launch_server --tp 2 --device cpu` (and `--tp 2 --dp 2 --enable-dp-attention`): two scheduler
ranks over gloo serve chat requests, /generate returns the single-rank engine's greedy tokens and prompt logprobs
(within 1e-5), and killing a rank stops the server with exit code 1 and a log line naming the rank, with no
scheduler process left behind."""

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


def _single_rank(input_ids, sampling: dict):
    """The in-process single-rank engine's outputs (with prompt logprobs) for `input_ids` (one list or several)."""
    import sglang

    eng = sglang.Engine(model_path="tiny-deepseek-v4", device="cpu", dtype="float32", log_level="warning",
                        max_total_tokens=4096, max_running_requests=4)
    try:
        return eng.generate(input_ids=input_ids, sampling_params=sampling, return_logprob=True, logprob_start_len=0)
    finally:
        eng.shutdown()


def test_tp2_server_serves_and_stops_when_a_rank_dies(tmp_path):
    ids = [100, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 11000]
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    ref = _single_rank(ids, sampling)

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


def test_dp_attention_server_matches_single_rank(tmp_path):
    """`--tp 2 --dp 2 --enable-dp-attention`: requests sent together land on both DP groups (round robin) and each
    returns the single-rank engine's greedy tokens and prompt logprobs."""
    import concurrent.futures

    prompts = [[100 + 37 * i + j for j in range(9 + 5 * i)] for i in range(4)]
    sampling = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    refs = _single_rank(prompts, sampling)

    server = launch([*ARGS, "--tp", "2", "--dp", "2", "--enable-dp-attention"], str(tmp_path), timeout=240)
    try:
        def one(ids):
            return httpx.post(f"{server.base_url}/generate", timeout=120, json={
                "input_ids": ids, "sampling_params": sampling, "return_logprob": True, "logprob_start_len": 0}).json()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, prompts))
        for g, r in zip(got, refs):
            assert g["output_ids"] == r["output_ids"]
            a = [lp for lp, _, _ in g["meta_info"]["input_token_logprobs"][1:]]
            b = [lp for lp, _, _ in r["meta_info"]["input_token_logprobs"][1:]]
            assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-deepseek-v4", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
        info = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
        assert info["dp_size"] == 2 and info["disable_cuda_graph"] and info["disable_overlap_schedule"]
    finally:
        server.stop()
