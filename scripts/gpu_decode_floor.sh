#!/usr/bin/env bash
# How far decode is from the bytes floor on flash-12l256e (Flash widths, 256 experts, 12 layers; CUDA graphs), in one
# call: the quantized checkpoint (drawn on the GPU, 4 GB shards), then bench_one_batch at batch 1, 8, 32 and 128 with
# 1,024-token prompts: kernels per step and per decoder layer (attributed to the layers, the LM head and the rest),
# every kernel of a step by name, and each batch's bytes floor (weights as stored, the experts the step touched, the
# cache its attention reads, over the copy bandwidth measured in the same run) and fraction of it.
#   bash scripts/gpu_decode_floor.sh       Logs and $OUT/decode_floor.json go to $OUT.
# A dry run on CPU: CONFIG=TINY_CONFIG_JSON DEVICE=cpu BATCHES="1 2" INPUT_LEN=64 bash scripts/gpu_decode_floor.sh
source "$(dirname "$0")/gpu_env.sh"
CONFIG=${CONFIG:-benchmark/configs/flash-12l256e.config.json}
W=${W:-/tmp/w/f12}
RESULT=$OUT/decode_floor.json

summary() {  # one line per batch from the JSON: what the tables above say, side by side
  python3 - "$RESULT" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    p, layers, f = r["profile"] or {}, r["layer_kernels"], r["floor"]
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
    print(f"batch {r['batch_size']:4d}: step {r['median_decode_latency_s'] * 1e3:.3f} ms | kernels/step "
          f"{fmt(p.get('kernels_per_step'), '.1f')} | kernels/layer "
          f"{fmt(layers and sum(layers['per_layer']) / len(layers['per_layer']), '.1f')} | outside the layers "
          f"{fmt(layers and layers['outside'], 'd')} | reads {f['total_bytes'] / 1e6:.1f} MB | floor "
          f"{fmt(f['floor_ms'], '.3f')} ms | fraction {fmt(f['fraction'], '.3f')}")
PY
}

TAIL=4 step "checkpoint" python3 scripts/make_slice_checkpoint.py "$CONFIG" "$W" --quantize --shard-gb 4 \
  --device "${DEVICE:-cuda}"
say "checkpoint: $(du -sh "$W" | cut -f1)"
rm -f "$RESULT"
# shellcheck disable=SC2086  # BATCHES is a list of sizes
TAIL=60 step "decode floor" python3 -m sglang.bench_one_batch --model-path "$W" --input-len "${INPUT_LEN:-1024}" \
  --output-len 32 --batch-size ${BATCHES:-1 8 32 128} --cuda-graph-bs 1 2 4 8 16 32 64 128 --prefill-repeats 1 \
  --kernel-table --result-filename "$RESULT"
step "summary" summary
finish
