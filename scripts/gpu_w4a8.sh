#!/usr/bin/env bash
# The W4A8 MoE (--mxfp4-moe-precision fp8, sgl_kernel/dsv4_moe_w4a8.py) on a GPU (issue 13): its
# GPU tests, the launch sweep (each kernel per token count; whole op with the best beside a8_config's and W4A16's),
# the whole op against W4A16 at Flash widths (bench_moe_mxfp4 both ways), and with ENGINE=1 (the default) the
# quantized flash-12l256e engine both ways, alternated twice (decode tok/s per batch size).
# Kernels and engine together exceed one device call's 10 minutes: run ENGINE=0, then KERNELS=0.
#   (device, carry .whl and out)  [SWEEP_S=240] [ENGINE=0 | KERNELS=0] [BATCHES="1 32"] bash scripts/gpu_w4a8.sh
# Logs: $OUT.
set -u -o pipefail
source scripts/gpu_env.sh
FAILED=()
step() { local name=$1; shift; echo "=== $name"; ( "$@" ) 2>&1 | tee -a "$OUT/w4a8_log.txt" | tail -"${TAIL:-20}" \
  || { FAILED+=("$name"); echo "=== FAILED: $name"; }; }
if [ "${KERNELS:-1}" = 1 ]; then
  TAIL=12 step "W4A8 GPU tests" python3 -m pytest -q -m gpu test/kernels/test_dsv4_moe_w4a8.py -p no:cacheprovider
  TAIL=30 step "W4A8 sweep" python3 benchmark/kernels/sweep_moe_w4a8.py --budget-s "${SWEEP_S:-240}" \
    --out "$OUT/sweep_w4a8.json"
  TAIL=8 step "whole op, W4A16 (parity planes)" python3 benchmark/bench_moe_mxfp4.py --planes \
    --tokens 1 2 4 8 32 128 256 4096 --out "$OUT/moe_w4a16.json"
  TAIL=8 step "whole op, W4A8" python3 benchmark/bench_moe_mxfp4.py --mxfp4-moe-precision fp8 \
    --tokens 1 2 4 8 32 128 256 4096 --out "$OUT/moe_w4a8.json"
fi
if [ "${ENGINE:-1}" = 1 ]; then
  W=/tmp/w/f12
  TAIL=4 step "checkpoint" python3 scripts/make_slice_checkpoint.py benchmark/configs/flash-12l256e.config.json "$W" \
    --quantize --shard-gb 4
  BATCHES=${BATCHES:-1 32}
  for round in 1 2; do
    for precision in bf16 fp8; do
      TAIL=3 step "engine $precision round $round" python3 -m sglang.bench_one_batch --model-path "$W" \
        --input-len 1024 --output-len 32 --batch-size $BATCHES --cuda-graph-bs $BATCHES --prefill-repeats 1 \
        --profile-steps 0 --mxfp4-moe-precision $precision
    done
  done
fi
if [ ${#FAILED[@]} -gt 0 ]; then printf 'failed step: %s\n' "${FAILED[@]}"; exit 1; fi
echo "all steps passed"
