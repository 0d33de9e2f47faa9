#!/usr/bin/env bash
# Prefix caching on a GPU in one call: the prefix-cache exactness tests on the GPU engine (fp32, CUDA graphs and
# overlap on), then bench_serving's multi-turn and generated-shared-prefix datasets against the Flash slice (bf16
# random weights) with the cache on and off: TTFT and prompt-token hit rate per run.
#   bash scripts/gpu_prefix_cache.sh      Logs and JSON lines go to $OUT.
# A dry run on CPU: MODEL=tiny-deepseek-v4 TESTS=0 SESSIONS=2 GSP_GROUPS=2 FIRST_LEN=300 TURN_LEN=40 bash scripts/gpu_prefix_cache.sh
source "$(dirname "$0")/gpu_env.sh"
[ "${TESTS:-1}" = 1 ] && TAIL=3 step "GPU prefix-cache tests" env SGLANG_TEST_DEVICE=cuda python3 -m pytest -q \
  -p no:cacheprovider test/srt/test_prefix_cache.py
if [ -z "${MODEL:-}" ]; then
  TAIL=2 step "checkpoint: Flash slice" python3 scripts/make_slice_checkpoint.py \
    benchmark/configs/flash-slice-4l32e.config.json /tmp/w/base
  MODEL="/tmp/w/base --dtype bfloat16"
fi
PORT=30600
for cache in on off; do
  extra=(); [ $cache = off ] && extra=(--disable-radix-cache)
  # shellcheck disable=SC2086
  if ! serve $PORT "$OUT/server_$cache.txt" --model-path $MODEL ${extra[@]+"${extra[@]}"}; then
    fail "server, cache $cache"
    stop_server
    continue
  fi
  TAIL=30 step "multi-turn, cache $cache" python3 -m sglang.bench_serving --backend sglang-oai-chat --port $PORT \
    --dataset-name multi-turn --mt-num-sessions "${SESSIONS:-32}" --mt-turns 4 --mt-first-len "${FIRST_LEN:-8192}" \
    --mt-turn-len "${TURN_LEN:-256}" --mt-output-len 64 --max-concurrency 16 --disable-tqdm \
    --output-file "$OUT/multi_turn_$cache.jsonl"
  TAIL=30 step "shared prefix, cache $cache" python3 -m sglang.bench_serving --backend sglang --port $PORT \
    --dataset-name generated-shared-prefix --gsp-num-groups "${GSP_GROUPS:-16}" --gsp-prompts-per-group 16 \
    --gsp-system-prompt-len "${FIRST_LEN:-8192}" --gsp-question-len "${TURN_LEN:-256}" --gsp-output-len 64 \
    --max-concurrency 16 --disable-tqdm --output-file "$OUT/shared_prefix_$cache.jsonl"
  stop_server
done
finish
