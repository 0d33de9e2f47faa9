"""The server with MTP speculative decoding: same greedy output as without, accept length in meta_info, /metrics,
/server_info's internal_states (as upstream SGLang) and bench_serving's report."""

from __future__ import annotations

import httpx

from server_process import launch

MODEL = "tiny-deepseek-v4"


def test_speculative_server(tmp_path):
    handle = launch(["--model-path", MODEL, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
                     "--enable-metrics", "--max-running-requests", "16", "--context-length", "1024"], str(tmp_path))
    try:
        import sglang
        from sglang import bench_serving

        ids = [5, 17, 300, 4000, 12, 99, 128803, 7]
        params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        served = httpx.post(f"{handle.base_url}/generate", json={"input_ids": ids, "sampling_params": params},
                            timeout=60).json()
        assert served["meta_info"]["spec_accept_length"] >= 1
        plain = sglang.Engine(model_path=MODEL, device="cpu", log_level="warning", max_running_requests=4,
                              context_length=1024)
        try:
            assert served["output_ids"] == plain.generate(input_ids=ids, sampling_params=params)["output_ids"]
        finally:
            plain.shutdown()
        port = handle.base_url.rsplit(":", 1)[1]
        args = bench_serving.parse_args(["--backend", "sglang", "--port", port, "--dataset-name", "random",
                                         "--num-prompts", "8", "--random-input-len", "32", "--random-output-len",
                                         "8", "--random-range-ratio", "1.0", "--disable-tqdm"])
        result = bench_serving.run_benchmark(args)
        assert result.completed == 8 and result.accept_length is not None and result.accept_length >= 1
        metrics = httpx.get(f"{handle.base_url}/metrics").text
        assert "sglang:spec_accept_length" in metrics
        # where upstream SGLang's bench_serving reads it
        assert handle.server_info()["internal_states"][0]["avg_spec_accept_length"] >= 1
        handle.wait_pools_free()
    finally:
        handle.stop()
