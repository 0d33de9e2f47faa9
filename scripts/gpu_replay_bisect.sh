#!/usr/bin/env bash
# GPU-only comparisons on hca128 with an FP8 KV cache, located op by op (scripts/debug_replay_eager.py):
#  1. replayed CUDA-graph decode against the same static path run eagerly: four orders (eager twice, replay twice,
#     replay vs eager, and warm run first with the prefix cache on; the last differs in the low bits because the
#     second run prefills only what the cache lacks: RESULTS.md "KV cache dtype"; test_gpu_cuda_graph.py flushes);
#  2. Triton vs torch backend in fp32 (test_gpu_triton_backend.py, max |logprob diff| 0.022): which pool bytes
#     differ and whether by one e4m3 / scale step (rounding-boundary flips) or more.
#   bash scripts/gpu_replay_bisect.sh   [CONFIGS="hca128 tiny"] [STEP_S=300]      Log: $OUT/log.txt
source "$(dirname "$0")/gpu_env.sh"
STEP_S=${STEP_S:-300}
DROP=Warning
for cfg in ${CONFIGS:-hca128}; do
  fp8=(--config "$cfg" --kv-cache-dtype fp8_e4m3)
  TAIL=30 step "$cfg: eager twice (is the eager static path deterministic?)" python3 scripts/debug_replay_eager.py \
    "${fp8[@]}" --sides triton:eager triton:eager
  TAIL=30 step "$cfg: replay twice" python3 scripts/debug_replay_eager.py "${fp8[@]}" --sides triton:replay triton:replay
  TAIL=30 step "$cfg: replay vs eager" python3 scripts/debug_replay_eager.py "${fp8[@]}" \
    --sides triton:replay triton:eager
  TAIL=30 step "$cfg: replay vs eager, warm, prefix cache on (the test's order)" python3 scripts/debug_replay_eager.py \
    "${fp8[@]}" --sides triton:replay triton:eager --radix --warm
  TAIL=45 step "$cfg: torch vs Triton backend, fp32" python3 scripts/debug_replay_eager.py "${fp8[@]}" \
    --sides torch:general triton:general --dtype float32 --show 40
done
TAIL=8 step "the tests" python3 -m pytest -q -rxXfE -m gpu -p no:cacheprovider --tb=line \
  test/srt/test_gpu_cuda_graph.py -k "fp8 and hca128"
finish
