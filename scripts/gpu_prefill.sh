#!/usr/bin/env bash
# Prefill on flash-12l256e (Flash widths, 256 experts, 12 layers; the hub's formats) against the matmul rate, in one
# call: the quantized checkpoint (drawn on the GPU, 4 GB shards), then bench_one_batch's prefill at 1 and 8 prompts of
# 1,024 and 8,192 tokens (the model's FLOPs over the median of 3 prefills, as a fraction of the bf16 8192^3 matmul rate
# measured in the same run; one profiled prefill per shape with every kernel by name), and one 131,072-token prompt in
# chunks against 16 x the 8,192-token time (the linear-in-length check).
#   bash scripts/gpu_prefill.sh       Logs and $OUT/prefill.json go to $OUT.
# A dry run on CPU: CONFIG=TINY_CONFIG_JSON DEVICE=cpu LENS="64 128" LONG=1024 bash scripts/gpu_prefill.sh
source "$(dirname "$0")/gpu_env.sh"
CONFIG=${CONFIG:-benchmark/configs/flash-12l256e.config.json}
W=${W:-/tmp/w/f12}
RESULT=$OUT/prefill.json
LONG=${LONG:-131072}

summary() {  # one line per shape from the JSON, and the long prompt over 16 x the 8K one
  python3 - "$RESULT" "$LONG" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
for r in rows:
    p = r.get("prefill_profile") or {}
    print(f"{r['batch_size']} x {r['input_len']}: prefill {r['prefill_latency_s'] * 1e3:.1f} ms, "
          f"{r['prefill_throughput_tok_s']:.0f} tok/s, {r['prefill_gflop_per_token']:.2f} GFLOP/token, "
          f"{r['prefill_tflops']:.1f} TFLOP/s = {fmt(r['prefill_matmul_fraction'], '.3f')} of the matmul rate | "
          f"GPU busy {fmt(p.get('gpu_busy'), '.2f')}")
    h = r.get("prefill_host_phases")
    if h:  # host work before the first kernel of the prefill's forwards, and the whole prefill's host phases
        print(f"    host ms: allocate {h['allocate_ms']:.2f} + batch {h['batch_ms']:.2f} + metadata "
              f"{h['metadata_ms']:.2f} before the first kernel; forward {h['forward_ms']:.2f}, wait {h['wait_ms']:.2f}, "
              f"other {h['other_ms']:.2f} of {h['step_ms']:.2f}")
long = [r for r in rows if r["input_len"] == int(sys.argv[2]) and r["batch_size"] == 1]
base = [r for r in rows if r["input_len"] == 8192 and r["batch_size"] == 1]
if long and base:
    ratio = long[0]["prefill_latency_s"] / (long[0]["input_len"] / 8192 * base[0]["prefill_latency_s"])
    print(f"{sys.argv[2]}-token prompt over {long[0]['input_len'] // 8192} x the 8,192-token time: {ratio:.3f}")
PY
}

TAIL=4 step "checkpoint" python3 scripts/make_slice_checkpoint.py "$CONFIG" "$W" --quantize --shard-gb 4 \
  --device "${DEVICE:-cuda}"
say "checkpoint: $(du -sh "$W" | cut -f1)"
rm -f "$RESULT"
# shellcheck disable=SC2086  # LENS is a list of lengths
TAIL=80 step "prefill" python3 -m sglang.bench_one_batch --model-path "$W" --device "${DEVICE:-cuda}" \
  --input-len ${LENS:-1024 8192} --batch-size 1 8 --output-len 2 --profile-steps 0 --profile-prefill --kernel-table \
  --disable-cuda-graph --result-filename "$RESULT"
[ "$LONG" -gt 0 ] && TAIL=8 step "long prompt" python3 -m sglang.bench_one_batch --model-path "$W" \
  --device "${DEVICE:-cuda}" --input-len "$LONG" --batch-size 1 --output-len 2 --profile-steps 0 --prefill-repeats 1 \
  --disable-cuda-graph --result-filename "$RESULT"
step "summary" summary
finish
