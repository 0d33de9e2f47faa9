"""Prefill/decode disaggregation with two tensor-parallel ranks on each side: a `--tp-size 2` prefill server and a
`--tp-size 2` decode server (four scheduler ranks over gloo, each with its own Mooncake TCP session on loopback),
behind the real sglang-router in its PD mode, under MTP speculative decoding, give one co-located engine's greedy
outputs, plain and streamed; each decode rank receives its copy of every request's state; a killed prefill server
fails only the requests waiting for it (5xx) and every decode rank's pools come back free. Both servers start in
parallel with the reference engine (about 60 s on two busy cores); the tests then take about 15 s."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from server_process import free_port, launch, launch_pd_router

pytest.importorskip("mooncake.engine", reason="the test extra installs mooncake-transfer-engine-non-cuda")
pytest.importorskip("sglang_router", reason="the test extra installs sglang-router")

MODEL = "tiny-deepseek-v4"
SPEC = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2"]
COMMON = ["--model-path", MODEL, "--device", "cpu", "--dtype", "float32", "--context-length", "1024",
          "--max-total-tokens", "4096", "--max-running-requests", "4", "--tp-size", "2", *SPEC]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[(37 * i + n) % 120000 + 5 for i in range(n)] for n in (11, 70)]


class Cluster:
    def __init__(self, tmp: str) -> None:
        self.bootstrap_port = free_port()
        self.hang_file = os.path.join(tmp, "hang-prefill")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            prefill = pool.submit(launch, [*COMMON, "--disaggregation-mode", "prefill",
                                           "--disaggregation-bootstrap-port", str(self.bootstrap_port)], tmp, 300,
                                  {"SGLANG_TEST_HANG_SCHEDULER_FILE": self.hang_file})
            decode = pool.submit(launch, [*COMMON, "--disaggregation-mode", "decode"], tmp, 300)
            self.refs = _reference()  # meanwhile: the co-located engine's outputs
            self.prefill, self.decode = prefill.result(), decode.result()
        self.router = launch_pd_router(self.prefill.base_url, self.bootstrap_port, self.decode.base_url, tmp)
        self.url = self.router.base_url

    def stop(self) -> None:
        self.router.stop()
        for handle in (self.prefill, self.decode):
            if handle.proc.poll() is None:
                handle.stop()


def _reference() -> list:
    """One co-located single-rank engine's greedy outputs (fp32: two ranks give the same tokens)."""
    import sglang

    eng = sglang.Engine(model_path=MODEL, device="cpu", dtype="float32", log_level="warning", context_length=1024,
                        max_total_tokens=4096, max_running_requests=4, speculative_algorithm="EAGLE",
                        speculative_num_steps=2)
    try:
        return [eng.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True) for ids in PROMPTS]
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("pd-tp")))
    yield c
    c.stop()


def test_tp2_pair_matches_colocated_plain_and_streamed(cluster):
    """About 10 s. Prompts shorter and longer than the window: plain /generate (tokens and logprobs) and streamed."""
    for ids, ref in zip(PROMPTS, cluster.refs):
        r = httpx.post(f"{cluster.url}/generate", json={"input_ids": ids, "sampling_params": GREEDY,
                                                        "return_logprob": True}, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["output_ids"] == ref["output_ids"] and len(got["output_ids"]) == 8
        assert got["meta_info"]["spec_accept_length"] >= 1
        a = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        b = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4

        streamed = []
        with httpx.stream("POST", f"{cluster.url}/generate", json={"input_ids": ids, "sampling_params": GREEDY,
                                                                   "stream": True}, timeout=120) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed = json.loads(line[6:])["output_ids"]
        assert streamed == ref["output_ids"]
    # the first rank's stats: every decode rank received a copy of each request's bytes
    sent = cluster.prefill.server_info()["scheduler_stats"]["transfer"]
    received = cluster.decode.server_info()["scheduler_stats"]["transfer"]
    assert sent["num_transfers"] >= 4 and sent["bytes"] == received["bytes"] > 0
    cluster.decode.wait_pools_free()  # every rank's
    cluster.prefill.wait_pools_free()


def test_killed_prefill_fails_its_waiting_requests_and_frees_every_decode_rank(cluster):
    """About 3 s; runs last (it kills the prefill server)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        open(cluster.hang_file, "w").close()  # every prefill rank stops before its next step
        waiting = [pool.submit(httpx.post, f"{cluster.url}/generate", json={
            "input_ids": [20 + i] * 30, "sampling_params": GREEDY}, timeout=120) for i in range(2)]
        deadline = time.time() + 60
        while cluster.decode.server_info()["scheduler_stats"]["transfer_queues"]["transferring"] != 2:
            assert time.time() < deadline, "the rooms never waited for their prefill"
            time.sleep(0.05)
        os.kill(cluster.prefill.proc.pid, signal.SIGKILL)  # its scheduler ranks die with it
        for fut in waiting:
            assert fut.result().status_code >= 500, fut.result().text
    cluster.decode.wait_pools_free()  # pools_all_free: every rank's
    assert httpx.get(f"{cluster.decode.base_url}/health_generate", timeout=60).status_code == 200
    cluster.decode.wait_pools_free()
