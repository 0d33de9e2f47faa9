#!/usr/bin/env bash
# flash-12l256e (Flash widths, the real 256 experts, 12 layers + MTP) on one GPU in one call: the quantized
# checkpoint (48 GB, drawn on the GPU, streamed into 4 GB shards), the bf16 load refused before loading, the quantized
# server's start-up log (weights vs checkpoint GB, pools, the warm-up), the first 8K prompt after start against
# warm ones, chat requests, bench_serving over WORKLOADS and the static decode step at the served batch sizes.
#   bash scripts/gpu_flash_12l256e.sh      Logs and $OUT/serving.jsonl, $OUT/decode.jsonl go to $OUT.
# WORKLOADS: "INPUTxOUTPUT@CONCURRENCY" each (random prompts, `--random-range-ratio 1`, as many prompts as the
# concurrency, at least 2, after 2 warm-up requests): the default is the 1,024 / 256 load at concurrency 64 (its
# median TPOT over the static step of batch 64) and the cookbook workload, 8,192 / 1,024 at concurrency 1, 16 and 64
# (one call of 600 s holds about two of them on a cold machine: name them, e.g. WORKLOADS="8192x1024@64").
# DECODE_BATCHES (default "1 16 32 64"): the static decode steps (bench_one_batch, DECODE_INPUT_LEN = 1,024-token
# prompts, graphs). A dry run on CPU (a tiny config with the real tokenizer's vocabulary, 129,280):
#   CONFIG=TINY_CONFIG_JSON DEVICE=cpu REFUSAL=0 WORKLOADS="64x8@4" DECODE_BATCHES="1 4" DECODE_INPUT_LEN=64 \
#   FIRST_LEN=64 bash scripts/gpu_flash_12l256e.sh
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

prefill_steps() {  # the server's "Prefill batch." lines from line $1 on: what the steps that prefilled cost
  python3 - "$OUT/server.txt" "$1" <<'PY'
import re, statistics, sys
lines = open(sys.argv[1]).read().splitlines()[int(sys.argv[2]) - 1:]
rows = [dict((k.strip(), float(v)) for k, v in re.findall(r"#?([a-z -]+): ([\d.]+)", line))
        for line in lines if "Prefill batch." in line]
if rows:
    ms, tok, dec = [r["step"] for r in rows], [r["new-token"] for r in rows], [r["decode-rows"] for r in rows]
    print(f"{len(rows)} prefilling steps: median {statistics.median(tok):.0f} prompt tokens and "
          f"{statistics.median(dec):.0f} decode rows a step, median {statistics.median(ms):.1f} ms, max "
          f"{max(ms):.1f} ms; {sum(tok) / sum(ms) * 1e3:.0f} prompt tok/s over their {sum(ms) / 1e3:.2f} s")
    for r in sorted(rows, key=lambda r: -r["step"])[:3]:
        print(f"  slowest: {r['new-seq']:.0f} new sequences, {r['new-token']:.0f} prompt tokens, "
              f"{r['decode-rows']:.0f} decode rows: {r['step']:.1f} ms")
compiled = [line.split("after the warm-up: ", 1)[-1][:1200] for line in lines
            if "compiled after the warm-up" in line]
print(f"{len(compiled)} Triton kernel variants compiled after the warm-up (utils/compile_watch.py)")
for line in compiled[:12]:
    print("  " + line)
PY
}

summary() {  # each workload's throughput, TTFT and TPOT; TPOT over the static step at its concurrency where measured
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
load = lambda name: [json.loads(x) for x in open(os.path.join(out, name))] if os.path.exists(
    os.path.join(out, name)) else []
steps = {r["batch_size"]: r["median_decode_latency_s"] * 1e3 for r in load("decode.jsonl")}
print("| input / output @ concurrency | completed | total tok/s | output tok/s | TTFT median ms | TPOT median ms | "
      "TPOT / static step |")
print("|---|---|---|---|---|---|---|")
for r in load("serving.jsonl"):
    c, step = r["max_concurrency"], steps.get(r["max_concurrency"])
    ratio = f"{r['median_tpot_ms'] / step:.2f} (step {step:.2f} ms)" if step else "n/a"
    print(f"| {r['args']['random_input_len']} / {r['args']['random_output_len']} @ {c} | {r['completed']} | "
          f"{r['total_throughput']:.0f} | {r['output_throughput']:.0f} | {r['median_ttft_ms']:.0f} | "
          f"{r['median_tpot_ms']:.2f} | {ratio} |")
PY
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
  for w in ${WORKLOADS:-1024x256@64 8192x1024@1 8192x1024@16 8192x1024@64}; do
    io=${w%@*} c=${w#*@} from=$(($(wc -l < "$OUT/server.txt") + 1))
    TAIL=12 step "bench_serving $w" python3 -m sglang.bench_serving --backend sglang --port $PORT \
      --dataset-name random --num-prompts $((c > 2 ? c : 2)) --random-input-len "${io%x*}" \
      --random-output-len "${io#*x}" --random-range-ratio 1.0 --max-concurrency "$c" --warmup-requests 2 \
      --disable-tqdm --output-file "$OUT/serving.jsonl"
    step "prefilling steps $w" prefill_steps "$from"
  done
else
  fail "server"
fi
stop_server
# shellcheck disable=SC2086  # DECODE_BATCHES is a list of sizes
[ -n "${DECODE_BATCHES-1 16 32 64}" ] && TAIL=8 step "decode" python3 -m sglang.bench_one_batch --model-path "$W" \
  --device "${DEVICE:-cuda}" --input-len "${DECODE_INPUT_LEN:-1024}" --output-len 64 --batch-size ${DECODE_BATCHES-1 16 32 64} \
  --prefill-repeats 1 --profile-steps 0 --result-filename "$OUT/decode.jsonl"
step "summary" summary
finish
