"""`python -m sglang.launch_server --tp 2 --device cpu` (and `--tp 2 --dp 2 --enable-dp-attention`): two scheduler
ranks over gloo serve chat requests, /generate returns the single-rank engine's greedy tokens and prompt logprobs
(within 1e-5), and killing a rank stops the server with exit code 1 and a log line naming the rank, with no
scheduler process left behind. Two nodes on loopback with DP attention."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

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


@pytest.fixture(scope="module")
def single_rank():
    """single_rank(input_ids, sampling): the in-process single-rank engine's outputs (with prompt logprobs) for
    `input_ids` (one list or several); one engine serves the module's tests, its prefix cache emptied before each
    call so every reference is a cold prefill."""
    import sglang

    eng = sglang.Engine(model_path="tiny-deepseek-v4", device="cpu", dtype="float32", log_level="warning",
                        max_total_tokens=4096, max_running_requests=4)

    def run(input_ids, sampling: dict):
        assert eng.flush_cache()
        return eng.generate(input_ids=input_ids, sampling_params=sampling, return_logprob=True, logprob_start_len=0)

    yield run
    eng.shutdown()


def _generate_matches(base_url: str, ids: list, sampling: dict, ref: dict) -> None:
    """/generate returns the reference's greedy tokens and its prompt logprobs within 1e-5."""
    got = httpx.post(f"{base_url}/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": sampling, "return_logprob": True, "logprob_start_len": 0}).json()
    assert got["output_ids"] == ref["output_ids"]
    a = [lp for lp, _, _ in got["meta_info"]["input_token_logprobs"][1:]]
    b = [lp for lp, _, _ in ref["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5


def test_tp2_server_serves_and_stops_when_a_rank_dies(tmp_path, single_rank):
    ids = [100, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 11000]
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    ref = single_rank(ids, sampling)

    server = launch([*ARGS, "--tp", "2"], str(tmp_path), timeout=240)
    try:
        ranks = _rank_pids(server.proc.pid)
        assert len(ranks) == 2, ranks
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-deepseek-v4", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
            "temperature": 0})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 8
        _generate_matches(server.base_url, ids, sampling, ref)

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


def test_dp_attention_server_matches_single_rank(tmp_path, single_rank):
    """`--tp 2 --dp 2 --enable-dp-attention`: requests sent together land on both DP groups (round robin), each
    returns the single-rank engine's greedy tokens and prompt logprobs, and the server's stats merge both groups'."""
    import concurrent.futures

    prompts = [[100 + 37 * i + j for j in range(9 + 5 * i)] for i in range(4)]
    sampling = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    refs = single_rank(prompts, sampling)

    server = launch([*ARGS, "--tp", "2", "--dp", "2", "--enable-dp-attention"], str(tmp_path), timeout=240,
                    env={"SGLANG_TORCH_PROFILER_DIR": str(tmp_path)})  # output_dir must lie under it
    try:
        traces = tmp_path / "traces"
        started = httpx.post(f"{server.base_url}/start_profile", timeout=60, json={"output_dir": str(traces)})
        assert started.status_code == 200, started.text
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # sent together: both groups get requests
            list(pool.map(lambda pr: _generate_matches(server.base_url, pr[0], sampling, pr[1]), zip(prompts, refs)))
        assert httpx.post(f"{server.base_url}/stop_profile", timeout=120).status_code == 200
        for _ in range(100):  # the first group's answer came back; every rank writes its own trace
            if sorted(p.name.rsplit("-TP-", 1)[1] for p in traces.iterdir()) == ["0.trace.json.gz", "1.trace.json.gz"]:
                break
            time.sleep(0.1)
        assert sorted(p.name.rsplit("-TP-", 1)[1] for p in traces.iterdir()) == ["0.trace.json.gz", "1.trace.json.gz"]
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-deepseek-v4", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
        info = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
        # decode on the static path (static DP rounds); overlap scheduling off under DP attention
        assert info["dp_size"] == 2 and not info["disable_cuda_graph"] and info["disable_overlap_schedule"]
        stats = server.wait_pools_free()  # both groups' stats, merged: every generated token counted once
        assert stats["num_generated_tokens"] == 4 * 5 + 4, stats
    finally:
        server.stop()


def test_two_nodes_on_loopback(tmp_path, single_rank):
    """`--tp 2 --nnodes 2 --dp 2 --enable-dp-attention`: node 1 runs rank 1 headless, node 0 serves; each node is one
    DP group, node 1's answering its requests over TCP (node 0's --dist-init-addr port + 1, whose messages are
    signed with a key node 0's rank 0 gave the ranks); a pickle anyone else sends that port is dropped unread, and
    the outputs equal the single-rank engine's; when node 0 stops, node 1 exits with code 1 within the bounded
    --dist-timeout. (The ranks meet and serve alike without DP attention: the DP-attention path is the superset.)"""
    import concurrent.futures
    import sys

    import zmq
    from server_process import free_port
    from test_scheduler_channel import Evil

    prompts = [[7, 300, 4000, 50, 600, 7000, 80, 900], [11, 222, 3333, 44, 555, 6666]]
    sampling = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    refs = single_rank(prompts, sampling)
    init_port, marker = free_port(span=2), str(tmp_path / "ran")  # port + 1: the DP groups' answers
    common = [*ARGS, "--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{init_port}",
              "--dist-timeout", "20", "--dp", "2", "--enable-dp-attention"]
    node1_log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--log-level", "info", *common,
                              "--node-rank", "1"], stdout=node1_log, stderr=subprocess.STDOUT)
    try:
        server = launch([*common, "--node-rank", "0"], str(tmp_path), timeout=240)
        try:
            assert _rank_pids(server.proc.pid) and len(_rank_pids(server.proc.pid)) == 1  # rank 0 only here
            attacker = zmq.Context.instance().socket(zmq.PUSH)
            attacker.setsockopt(zmq.LINGER, 1000)
            attacker.connect(f"tcp://127.0.0.1:{init_port + 1}")
            attacker.send_pyobj(Evil(marker))  # what node 0 unpickled from anyone before its messages were signed
            attacker.send(b"not a message")
            attacker.close()
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # together: round robin over both DP groups
                list(pool.map(lambda pr: _generate_matches(server.base_url, pr[0], sampling, pr[1]),
                              zip(prompts, refs)))
            for _ in range(300):  # the attacker's messages were read (and dropped) meanwhile
                if "on the scheduler channel" in open(server.log_path).read():
                    break
                time.sleep(0.1)
            assert "dropped 1 message(s) on the scheduler channel" in open(server.log_path).read()
            assert not os.path.exists(marker)
        finally:
            server.stop()
        assert node1.wait(timeout=90) == 1
        log = open(tmp_path / "node1.log").read()
        assert "node 1 of 2: ranks 1..1 ready" in log and "node 1 stopped: scheduler rank 1" in log, log[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
