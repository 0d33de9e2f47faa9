#!/usr/bin/env bash
# Serving throughput on the standard Flash-slice workload (bf16 random weights) in one GPU call: a server with
# --max-running-requests 256, then bench_serving at concurrency 256 with max_tokens set and without it
# (chat without max_tokens, --omit-max-tokens: the client reads the output length and disconnects, as if the answer
# had ended there; the server admits by estimate what would otherwise reserve the context length).
# The server's peak running requests, retractions and new-token ratio are polled from /server_info.
#   bash scripts/gpu_bench_serving.sh          (.whl_serve: the server's wheels, where the image lacks them)
# SERVER_SRC=DIR serves from another checkout (an older commit, for comparison); MODES picks the runs.
# A dry run on CPU: MODEL=tiny-deepseek-v4 NUM_PROMPTS=8 INPUT_LEN=32 OUTPUT_LEN=8 CONCURRENCY=4 bash ...
source "$(dirname "$0")/gpu_env.sh"
CONFIG=benchmark/configs/flash-slice-4l32e.config.json
if [ -z "${MODEL:-}" ]; then
  TAIL=2 step "checkpoint: Flash slice" python3 scripts/make_slice_checkpoint.py "$CONFIG" /tmp/w/base
  MODEL="/tmp/w/base --dtype bfloat16"
fi
PORT=30500
SRC=${SERVER_SRC:-$PWD}  # the engine checkout that serves (the client is always this one)

modes() {  # each of MODES against the server, one JSON row per mode in $OUT/serving_summary.jsonl
  python3 - "$PORT" "$OUT" <<'PY'
import json, os, sys, threading, time
import httpx
from sglang import bench_serving

port, out = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
info = httpx.get(f"{base}/server_info").json()
print("max_total_num_tokens", info.get("max_total_num_tokens"))
for mode in os.environ.get("MODES", "max_tokens omit_max_tokens").split():
    peak, stop = {"running": 0, "queued": 0}, threading.Event()

    def poll():
        while not stop.is_set():
            s = httpx.get(f"{base}/server_info", timeout=10).json()["scheduler_stats"] or {}  # None before a step
            peak["running"] = max(peak["running"], s.get("num_running_reqs", 0))
            peak["queued"] = max(peak["queued"], s.get("num_waiting_reqs", 0))
            time.sleep(0.25)

    env = os.environ.get
    argv = ["--backend", "sglang-oai-chat", "--port", port, "--dataset-name", "random",
            "--num-prompts", env("NUM_PROMPTS", "768"), "--random-input-len", env("INPUT_LEN", "1024"),
            "--random-output-len", env("OUTPUT_LEN", "256"), "--random-range-ratio", "1.0",
            "--max-concurrency", env("CONCURRENCY", "256"), "--warmup-requests", "16", "--disable-tqdm",
            "--output-file", f"{out}/serving.jsonl"]
    if mode == "omit_max_tokens":
        argv.append("--omit-max-tokens")
    args = bench_serving.parse_args(argv)
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    result = bench_serving.run_benchmark(args)
    stop.set()
    thread.join()
    stats = httpx.get(f"{base}/server_info").json()["scheduler_stats"]
    stats.setdefault("num_retractions", None)  # a server from before retraction existed (SERVER_SRC)
    stats.setdefault("new_token_ratio", None)
    row = {"mode": mode, "server_src": os.environ.get("SERVER_SRC", "."), "completed": result.completed, "failed": result.failed,
           "output_throughput": result.output_throughput, "total_throughput": result.total_throughput,
           "mean_ttft_ms": result.mean_ttft_ms, "mean_tpot_ms": result.mean_tpot_ms,
           "server_peak_running": peak["running"], "server_peak_queued": peak["queued"],
           "num_retractions": stats["num_retractions"], "new_token_ratio": stats["new_token_ratio"]}
    print(json.dumps(row))
    with open(f"{out}/serving_summary.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
PY
}

# shellcheck disable=SC2086
if PYTHONPATH=/tmp/site:$SRC/python:$SRC/sgl-kernel/python${PYTHONPATH#*sgl-kernel/python} serve $PORT \
    "$OUT/server_log.txt" --model-path $MODEL --max-running-requests 256 --enable-metrics; then
  grep -E "pool|CUDA graph|full tokens|concurrent" "$OUT/server_log.txt" | head -12
  TAIL=12 step "bench_serving: ${MODES:-max_tokens omit_max_tokens}" modes
  grep -E "new-token ratio|retracted" "$OUT/server_log.txt" | tail -4
else
  fail "server"
fi
finish
