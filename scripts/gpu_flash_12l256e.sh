#!/usr/bin/env bash
# flash-12l256e (Flash widths, the real 256 experts, 12 layers + MTP) on one H200 in one device call (issue 13): the
# quantized checkpoint (48 GB, drawn on the GPU, streamed into 4 GB shards), the bf16 load refused before loading,
# the quantized server's start-up log (weights vs checkpoint GB, pools), chat requests, and decode speed.
#   bash scripts/gpu_flash_12l256e.sh   (carry .whl and .whl_serve)   Logs go to $OUT.
# A dry run on CPU: CONFIG=TINY_CONFIG_JSON DEVICE=cpu REFUSAL=0 DECODE=0 NUM_PROMPTS=4 INPUT_LEN=64 bash ...
set -u -o pipefail
source scripts/gpu_env.sh
CONFIG=${CONFIG:-benchmark/configs/flash-12l256e.config.json}
W=${W:-/tmp/w/f12}
FAILED=()
start=$(date +%s)
python3 scripts/make_slice_checkpoint.py "$CONFIG" "$W" --quantize --shard-gb 4 --device "${DEVICE:-cuda}" \
  > "$OUT/checkpoint.txt" 2>&1 || { tail -20 "$OUT/checkpoint.txt"; exit 1; }
echo "checkpoint: $(du -sh "$W" | cut -f1) in $(( $(date +%s) - start )) s"
if [ "${REFUSAL:-1}" = 1 ]; then  # the same config in bf16 must be refused before loading, saying what it needs
  python3 -m sglang.bench_one_batch --model-path "$W" --quantization none --batch-size 1 --input-len 16 \
    --output-len 2 > "$OUT/bf16_refused.txt" 2>&1 && FAILED+=("bf16 load was not refused")
  grep -iE "GB|memory" "$OUT/bf16_refused.txt" | tail -3
fi
PORT=30700
python3 -m sglang.launch_server --model-path "$W" --port $PORT --max-running-requests 64 --served-model-name f12 > "$OUT/server.txt" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
wait_healthy $PORT $SERVER "$OUT/server.txt" 900 || exit 1
grep -E "weights on|quantization|page size|full tokens|staging|CUDA graph" "$OUT/server.txt" | head -10
for i in 1 2 3; do
  curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"f12\", \"messages\": [{\"role\": \"user\", \"content\": \"Question $i: count to ten.\"}], \"max_tokens\": 24}" \
    > "$OUT/chat_$i.json" || FAILED+=("chat $i")
  python3 -c "import json,sys; r=json.load(open('$OUT/chat_$i.json')); print('chat', $i, r['usage'])" \
    || FAILED+=("chat $i answer")
done
python3 -m sglang.bench_serving --backend sglang --port $PORT --dataset-name random --num-prompts "${NUM_PROMPTS:-64}" \
  --random-input-len "${INPUT_LEN:-1024}" --random-output-len 128 --random-range-ratio 1.0 --max-concurrency 32 --disable-tqdm \
  > "$OUT/serving.txt" 2>&1 || FAILED+=("bench_serving")
grep -E "Successful|Output token throughput|Median TTFT|Median TPOT" "$OUT/serving.txt"
kill $SERVER; wait $SERVER 2>/dev/null
if [ "${DECODE:-1}" = 1 ]; then
  python3 -m sglang.bench_one_batch --model-path "$W" --input-len 1024 --output-len 32 --batch-size 1 32 \
    --cuda-graph-bs 1 2 4 8 16 32 --profile-steps 0 > "$OUT/decode.txt" 2>&1 || FAILED+=("decode")
  grep -E "^batch|weights" "$OUT/decode.txt"
fi
if [ ${#FAILED[@]} -gt 0 ]; then printf 'failed step: %s\n' "${FAILED[@]}"; exit 1; fi
echo "all steps passed"
