#!/usr/bin/env bash
# Speculative decoding (MTP draft, 3-1-4: 3 draft steps, top-1, 4 tokens verified) against plain decode on the
# quantized flash-12l256e (Flash widths, 256 experts, 12 layers; FP8 linears, MXFP4 experts; CUDA graphs), in one
# call: the predictable checkpoint (every draft accepted; drawn and quantized on the GPU, 4 GB shards, 45 GB), then
# per batch plain and speculative tok/s, the speed-up, the accept length, GPU ms per plain step and per cycle, the
# cycle's cost in plain steps, the GPU-bound limit of the speed-up, launches and kernels per step and per cycle.
#   bash scripts/gpu_speculative.sh [bench_speculative.py options]     Logs and $OUT/speculative.json go to $OUT.
# A dry run on CPU: CONFIG=TINY_CONFIG_JSON BATCHES="1 2" bash scripts/gpu_speculative.sh --prompt-len 16 \
#   --new-tokens 9 --profile-steps 2
source "$(dirname "$0")/gpu_env.sh"
CONFIG=${CONFIG:-benchmark/configs/flash-12l256e.config.json}
W=${W:-/tmp/w/spec}

# shellcheck disable=SC2086  # BATCHES is a list of sizes
TAIL=${TAIL:-12} step "speculative 3-1-4 vs plain" python3 benchmark/bench_speculative.py --config "$CONFIG" \
  --quantize --steps 3 --batch ${BATCHES:-1 8} --work-dir "$W" --out "$OUT/speculative.json" "$@"
say "checkpoint: $(du -sh "$W" | cut -f1)"
finish
