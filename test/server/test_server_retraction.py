"""The server under memory pressure: chat requests without max_tokens on a pool far smaller than their worst case are
admitted by estimate, the pool runs out mid-decode, requests are retracted and resumed, and every client gets a
complete answer (200, finish "length" at the context), the same answer as the identical request beside it.
/metrics counts the retractions and the queue times; /server_info reports the new-token ratio."""

from __future__ import annotations

import asyncio
import re

import httpx

from server_process import launch
from sglang.srt.environ import envs

MODEL = "tiny-deepseek-v4"


def test_chat_without_max_tokens_under_pressure(tmp_path):
    # 4 pages of 128 tokens; a chat without max_tokens may grow to the context (160): 2 pages, so 4 chats admitted
    # together (one page each) run out when they cross into their second page. The clip of the estimate is scaled to
    # this pool (inherited by the server process).
    # The warm-up (forced on CPU) runs before the server is ready and leaves no trace in the pools or the metrics.
    with envs.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.override(8), envs.SGLANG_SERVER_WARMUP_ON_CPU.override(1):
        handle = launch(["--model-path", MODEL, "--enable-metrics", "--max-total-tokens", "512", "--page-size", "128",
                         "--max-running-requests", "8", "--chunked-prefill-size", "64", "--context-length", "160"],
                        str(tmp_path))
    try:
        async def one(client, i):
            body = {"model": MODEL, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"tell story number {i % 2}"}]}
            r = await client.post("/v1/chat/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()

        async def main():
            async with httpx.AsyncClient(base_url=handle.base_url) as client:
                return await asyncio.gather(*(one(client, i) for i in range(4)))

        info = httpx.get(f"{handle.base_url}/server_info").json()
        assert info["warmup_forwards"] > 0 and info["scheduler_stats"]["num_generated_tokens"] == 0
        answers = asyncio.run(main())
        for i, answer in enumerate(answers):
            usage, choice = answer["usage"], answer["choices"][0]
            assert choice["finish_reason"] == "length"
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 160  # max_tokens: up to the context
            twin = answers[(i + 2) % 4]  # the same prompt
            assert choice["message"]["content"] == twin["choices"][0]["message"]["content"]
        metrics = httpx.get(f"{handle.base_url}/metrics").text
        retractions = float(re.search(r"^sglang:num_retractions_total\{[^}]*\} (\S+)$", metrics, re.M).group(1))
        queued = float(re.search(r"^sglang:queue_time_seconds_count\{[^}]*\} (\S+)$", metrics, re.M).group(1))
        assert retractions > 0 and queued == 4
        stats = handle.wait_pools_free()
        assert stats["num_retractions"] == retractions and 0 < stats["new_token_ratio"] <= 1

        # bench_serving --omit-max-tokens: no max_tokens sent; each client reads 12 tokens and disconnects, and the
        # server aborts the request and frees its slots
        from sglang import bench_serving

        port = handle.base_url.rsplit(":", 1)[1]
        args = bench_serving.parse_args(["--backend", "sglang", "--port", port, "--dataset-name", "random",
                                         "--num-prompts", "6", "--random-input-len", "16", "--random-output-len",
                                         "12", "--random-range-ratio", "1.0", "--omit-max-tokens", "--disable-tqdm"])
        result = bench_serving.run_benchmark(args)
        assert result.completed == 6 and result.failed == 0
        assert all(o.output_len >= 12 and o.finish_reason == "client_stop" for o in result.outputs)
        handle.wait_pools_free()
    finally:
        handle.stop()
