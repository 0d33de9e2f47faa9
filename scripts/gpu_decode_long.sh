#!/usr/bin/env bash
# Decode at a long context against a short one on flash-12l256e (quantized hub formats, CUDA graphs, batch 1), in one
# call: the per-token decode time at a 1,024-token and a 131,072-token prompt, and their ratio. The sparse path reads
# a bounded top-k of the compressed entries, so the long context should cost little more a token.
#   bash scripts/gpu_decode_long.sh        Logs and $OUT/decode_long.json go to $OUT.
# SHORT=N / LONG=N set the prompts; a dry run on CPU: CONFIG=TINY_CONFIG_JSON DEVICE=cpu SHORT=256 LONG=900 bash scripts/gpu_decode_long.sh
source "$(dirname "$0")/gpu_env.sh"
CONFIG=${CONFIG:-benchmark/configs/flash-12l256e.config.json}
W=${W:-/tmp/w/f12}
SHORT=${SHORT:-1024}
LONG=${LONG:-131072}
RESULT=$OUT/decode_long.json

ratio() {
  python3 - "$RESULT" <<'PY'
import json, sys
rows = {r["input_len"]: r for r in map(json.loads, open(sys.argv[1]))}
short, long_ = min(rows), max(rows)
t = {n: rows[n]["median_decode_latency_s"] * 1e3 for n in rows}
print(f"decode ms/token: {short} tokens {t[short]:.3f}, {long_} tokens {t[long_]:.3f}, ratio {t[long_] / t[short]:.3f}")
PY
}

[ -d "$W" ] || TAIL=4 step "checkpoint" python3 scripts/make_slice_checkpoint.py "$CONFIG" "$W" --quantize \
  --shard-gb 4 --device "${DEVICE:-cuda}"
rm -f "$RESULT"
# One prefill per prompt length beyond the warm-up (--prefill-repeats 1, no profile passes): a long prefill is slow.
TAIL=12 step "decode, short and long context" python3 -m sglang.bench_one_batch --model-path "$W" \
  --input-len "$SHORT" "$LONG" --output-len 32 --batch-size 1 --cuda-graph-bs 1 --prefill-repeats 1 --profile-steps 0 \
  --result-filename "$RESULT"
step "ratio" ratio
finish
