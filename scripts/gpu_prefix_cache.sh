#!/usr/bin/env bash
# Prefix caching on a GPU in one device call (issue 15): the prefix-cache exactness tests on the GPU engine (fp32,
# CUDA graphs and overlap on), then bench_serving's multi-turn and generated-shared-prefix datasets against the
# Flash slice (bf16 random weights) with the cache on and off: TTFT and prompt-token hit rate per run.
#   bash scripts/gpu_prefix_cache.sh   (carry .whl and .whl_serve: the test and server wheels for Python 3.12)
# A dry run on CPU: MODEL=tiny-deepseek-v4 TESTS=0 SESSIONS=2 GSP_GROUPS=2 FIRST_LEN=300 TURN_LEN=40 bash scripts/gpu_prefix_cache.sh
set -u -o pipefail
source scripts/gpu_env.sh
FAILED=()
if [ "${TESTS:-1}" = 1 ]; then
  SGLANG_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider test/srt/test_prefix_cache.py \
    > "$OUT/prefix_cache_tests.txt" 2>&1 || FAILED+=("GPU prefix-cache tests")
  tail -3 "$OUT/prefix_cache_tests.txt"
fi
if [ -z "${MODEL:-}" ]; then
  python3 scripts/make_slice_checkpoint.py benchmark/configs/flash-slice-4l32e.config.json /tmp/w/base || exit 1
  MODEL="/tmp/w/base --dtype bfloat16"
fi
PORT=30600
for cache in on off; do
  extra=""; [ $cache = off ] && extra="--disable-radix-cache"
  python3 -m sglang.launch_server --model-path $MODEL --port $PORT $extra > "$OUT/server_$cache.txt" 2>&1 &
  SERVER=$!
  wait_healthy $PORT $SERVER "$OUT/server_$cache.txt" 600 || exit 1
  python3 -m sglang.bench_serving --backend sglang-oai-chat --port $PORT --dataset-name multi-turn \
    --mt-num-sessions "${SESSIONS:-32}" --mt-turns 4 --mt-first-len "${FIRST_LEN:-8192}" --mt-turn-len "${TURN_LEN:-256}" \
    --mt-output-len 64 --max-concurrency 16 --disable-tqdm --output-file "$OUT/multi_turn_$cache.jsonl" \
    > "$OUT/multi_turn_$cache.txt" 2>&1 || FAILED+=("multi-turn, cache $cache")
  python3 -m sglang.bench_serving --backend sglang --port $PORT --dataset-name generated-shared-prefix \
    --gsp-num-groups "${GSP_GROUPS:-16}" --gsp-prompts-per-group 16 --gsp-system-prompt-len "${FIRST_LEN:-8192}" \
    --gsp-question-len "${TURN_LEN:-256}" --gsp-output-len 64 --max-concurrency 16 --disable-tqdm \
    --output-file "$OUT/shared_prefix_$cache.jsonl" > "$OUT/shared_prefix_$cache.txt" 2>&1 \
    || FAILED+=("shared prefix, cache $cache")
  kill $SERVER; wait $SERVER 2>/dev/null
  for run in multi_turn shared_prefix; do
    echo "== $run, cache $cache"
    grep -E "Successful|hit rate|Median TTFT|Mean TTFT|P99 TTFT|duration" "$OUT/${run}_$cache.txt"
  done
done
if [ ${#FAILED[@]} -gt 0 ]; then printf 'failed step: %s\n' "${FAILED[@]}"; exit 1; fi
echo "all steps passed"
