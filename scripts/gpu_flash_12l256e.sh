#!/usr/bin/env bash
# flash-12l256e (Flash widths, the real 256 experts, 12 layers + MTP) on one GPU in one call: the quantized
# checkpoint (48 GB, drawn on the GPU, streamed into 4 GB shards), the bf16 load refused before loading, the quantized
# server's start-up log (weights vs checkpoint GB, pools, the warm-up), the first 8K prompt after start against
# warm ones, chat requests, bench_serving and decode speed.
#   bash scripts/gpu_flash_12l256e.sh      Logs go to $OUT.
# A dry run on CPU: CONFIG=TINY_CONFIG_JSON DEVICE=cpu REFUSAL=0 DECODE=0 NUM_PROMPTS=4 INPUT_LEN=64 FIRST_LEN=64 bash ...
source "$(dirname "$0")/gpu_env.sh"
CONFIG=${CONFIG:-benchmark/configs/flash-12l256e.config.json}
W=${W:-/tmp/w/f12}
PORT=30700

first_prompts() {  # the first long prompt after start against warm ones (the warm-up compiled its kernels)
  python3 - "$PORT" "${FIRST_LEN:-8192}" <<'PY'
import random, sys, time
import httpx
port, n = sys.argv[1], int(sys.argv[2])
info = httpx.get(f"http://127.0.0.1:{port}/server_info").json()
times = []
for i in range(4):  # distinct random prompts: no prefix-cache hit
    ids = [random.Random(i).randrange(3, 500) for _ in range(n)]  # valid ids for any vocabulary
    t0 = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}}, timeout=600)
    r.raise_for_status()
    times.append(time.perf_counter() - t0)
warm = sorted(times[1:])[1]
print(f"warm-up forwards {info['warmup_forwards']}; {n}-token prompt: first {times[0]:.3f} s, warm median "
      f"{warm:.3f} s: first / warm {times[0] / warm:.2f}")
PY
}

refused() {  # the same config in bf16 must be refused before loading, saying what it needs
  if python3 -m sglang.bench_one_batch --model-path "$W" --quantization none --batch-size 1 --input-len 16 \
      --output-len 2 > "$OUT/bf16_refused.txt" 2>&1; then
    echo "the bf16 load was not refused"; return 1
  fi
  grep -iE "GB|memory" "$OUT/bf16_refused.txt" | tail -3
}

chat() {  # chat I: one chat completion, its usage printed
  curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"f12\", \"messages\": [{\"role\": \"user\", \"content\": \"Question $1: count to ten.\"}], \"max_tokens\": 24}" \
    > "$OUT/chat_$1.json" \
    && python3 -c "import json; r = json.load(open('$OUT/chat_$1.json')); print('chat', $1, r['usage'])"
}

TAIL=6 step "limits: copy bandwidth, bf16 matmul" python3 benchmark/kernels/run_all.py --only none
TAIL=4 step "checkpoint" python3 scripts/make_slice_checkpoint.py "$CONFIG" "$W" --quantize --shard-gb 4 \
  --device "${DEVICE:-cuda}"
say "checkpoint: $(du -sh "$W" | cut -f1)"
[ "${REFUSAL:-1}" = 1 ] && step "bf16 refused" refused
HEALTHY_S=900
if serve $PORT "$OUT/server.txt" --model-path "$W" --max-running-requests 64 --served-model-name f12; then
  grep -E "weights on|quantization|page size|full tokens|staging|CUDA graph|warm-up" "$OUT/server.txt" | head -11
  step "first prompt after start vs warm" first_prompts
  for i in 1 2 3; do step "chat $i" chat $i; done
  TAIL=30 step "bench_serving" python3 -m sglang.bench_serving --backend sglang --port $PORT --dataset-name random \
    --num-prompts "${NUM_PROMPTS:-64}" --random-input-len "${INPUT_LEN:-1024}" --random-output-len 128 \
    --random-range-ratio 1.0 --max-concurrency 32 --disable-tqdm
else
  fail "server"
fi
stop_server
[ "${DECODE:-1}" = 1 ] && TAIL=6 step "decode" python3 -m sglang.bench_one_batch --model-path "$W" --input-len 1024 \
  --output-len 32 --batch-size 1 32 --cuda-graph-bs 1 2 4 8 16 32 --profile-steps 0
finish
