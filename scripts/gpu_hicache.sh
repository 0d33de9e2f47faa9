#!/usr/bin/env bash
# The hierarchical prefix cache on a GPU in one call: the host/file-tier exactness tests on the GPU engine (fp32,
# pinned host memory, CUDA graphs and overlap on), then benchmark/bench_agentic.py against the Flash slice (bf16
# random weights): 16 agentic sessions x 5 turns, each turn 2,048 new tokens over a 1,024-token shared system prompt,
# on a device pool holding a quarter of their working set (165K tokens): device-only vs host tier vs an unbounded pool
# (and the file tier after a restart), with the pinned host <-> device copy bandwidth measured in the same run.
#   bash scripts/gpu_hicache.sh      Logs and JSON go to $OUT.
# IO_BACKENDS="kernel direct" / WRITE_POLICIES="write_through write_back": a host run for each (the first is `host`).
# A dry run on CPU: MODEL=tiny-deepseek-v4 DEVICE=cpu TESTS=0 SESSIONS=4 TURNS=2 SYSTEM=512 TURN=128 bash scripts/gpu_hicache.sh
source "$(dirname "$0")/gpu_env.sh"
[ "${TESTS:-1}" = 1 ] && TAIL=3 step "GPU hierarchical-cache tests" env SGLANG_TEST_DEVICE=cuda python3 -m pytest -q \
  -p no:cacheprovider test/srt/test_hicache.py test/srt/test_tier_copy.py -k "not retraction"
if [ -z "${MODEL:-}" ]; then
  TAIL=2 step "checkpoint: Flash slice" python3 scripts/make_slice_checkpoint.py \
    benchmark/configs/flash-slice-4l32e.config.json /tmp/w/base --device "${DEVICE:-cuda}"
  MODEL="/tmp/w/base --dtype bfloat16"
fi
rm -rf /tmp/w/hicache_files
FILES=(--storage-dir /tmp/w/hicache_files)
[ "${FILE_TIER:-1}" = 0 ] && FILES=()  # FILE_TIER=0: no restarted engine on the file tier (a shorter call)
# shellcheck disable=SC2086
TAIL=12 step "agentic sessions" python3 benchmark/bench_agentic.py --model-path $MODEL --device "${DEVICE:-cuda}" \
  --sessions "${SESSIONS:-16}" --turns "${TURNS:-5}" --system-tokens "${SYSTEM:-1024}" --turn-tokens "${TURN:-2048}" \
  --io-backend ${IO_BACKENDS:-kernel} --write-policy ${WRITE_POLICIES:-write_through} "${FILES[@]}" \
  --out "$OUT/agentic.json"
finish
