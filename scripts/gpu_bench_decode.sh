#!/usr/bin/env bash
# Decode speed on the standard Flash-slice workload (bf16 random weights, prompt 1024) in one GPU call: the same-run
# ceilings and the HF eager peer (hf_peer.py), bench_one_batch with CUDA graphs and with --disable-cuda-graph, and
# speculative 3-1-4 with the predictable draft. Results (JSON lines) and the log go to $OUT.
#   bash scripts/gpu_bench_decode.sh [no-spec]      (EAGER=0: skip the --disable-cuda-graph comparison)
# .whl_peer (transformers >= 5.24 and hf_peer.py, the peer's script) enables the peer step.
source "$(dirname "$0")/gpu_env.sh"
CONFIG=benchmark/configs/flash-slice-4l32e.config.json
step "checkpoint" python3 scripts/make_slice_checkpoint.py "$CONFIG" /tmp/w/base
if [ -d .whl_peer ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer .whl_peer/*.whl
  step "hf peer" env PYTHONPATH=/tmp/peer python3 .whl_peer/hf_peer.py "$CONFIG" --batch 1 8 --prompt 1024 --new 32 \
    --out "$OUT/hf_peer.json"
fi
BENCH="python3 -m sglang.bench_one_batch --model-path /tmp/w/base --dtype bfloat16 --input-len 1024 --output-len 32"
step "engine, CUDA graphs" $BENCH --batch-size 1 8 32 128 --result-filename "$OUT/decode_graphs.jsonl"
[ "${EAGER:-1}" = 0 ] || step "engine, --disable-cuda-graph" $BENCH --batch-size 1 32 --disable-cuda-graph \
  --result-filename "$OUT/decode_eager.jsonl"
[ "${1:-}" = no-spec ] || step "speculative 3-1-4" python3 benchmark/bench_speculative.py --config "$CONFIG" \
  --work-dir /tmp/w --steps 3 --batch 1 16 --out "$OUT/speculative.json"
finish
