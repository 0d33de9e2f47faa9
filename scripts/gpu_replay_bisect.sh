#!/usr/bin/env bash
# GPU-only comparisons on hca128 with an FP8 KV cache, located op by op (scripts/debug_replay_eager.py):
#  1. replayed CUDA-graph decode against the same static path run eagerly: four orders (eager twice, replay twice,
#     replay vs eager, and warm run first with the prefix cache on; the last differs in the low bits because the
#     second run prefills only what the cache lacks: 2026-12-05, RESULTS.md; test_gpu_cuda_graph.py now flushes);
#  2. Triton vs torch backend in fp32 (test_gpu_triton_backend.py, max |logprob diff| 0.022): which pool bytes
#     differ and whether by one e4m3 / scale step (rounding-boundary flips) or more.
#   bash scripts/gpu_replay_bisect.sh   (device tool; carry .whl)   [CONFIGS="hca128 tiny"]   Log: $OUT/replay_bisect.txt
set -u -o pipefail
source scripts/gpu_env.sh
LOG="$OUT/replay_bisect.txt"
run() {
  echo "=== $*" | tee -a "$LOG"
  timeout -k 5 "${STEP_S:-300}" python3 scripts/debug_replay_eager.py "$@" 2>&1 | { grep -v Warning || true; } \
    | tail -"${TAIL:-30}" | tee -a "$LOG"
}
for cfg in ${CONFIGS:-hca128}; do
  fp8=(--config "$cfg" --kv-cache-dtype fp8_e4m3)
  run "${fp8[@]}" --sides triton:eager triton:eager  # is the eager static path deterministic?
  run "${fp8[@]}" --sides triton:replay triton:replay
  run "${fp8[@]}" --sides triton:replay triton:eager
  run "${fp8[@]}" --sides triton:replay triton:eager --radix --warm  # the test's order
  TAIL=45 run "${fp8[@]}" --sides torch:general triton:general --dtype float32 --show 40
done
echo "=== the tests" | tee -a "$LOG"
python3 -m pytest -q -rxXfE -m gpu -p no:cacheprovider --tb=line test/srt/test_gpu_cuda_graph.py -k "fp8 and hca128" \
  2>&1 | tail -8 | tee -a "$LOG"
