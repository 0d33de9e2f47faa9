#!/usr/bin/env bash
# This checkout's engine against another revision's, on the quantized flash-12l256e, in one device call: decode tok/s
# (CUDA graphs) and prefill per batch size, the two alternated ROUNDS times in one process order (A B A B ...), so a
# change's end-to-end effect is read against the same GPU, clocks and checkpoint.
#   Here first:  rm -rf out/rev && mkdir -p out/rev && git archive REV python sgl-kernel | tar -x -C out/rev
#   Then (device, carry .whl and out):  [ROUNDS=2] [BATCHES="1 32"] bash scripts/gpu_engine_ab.sh      Logs: $OUT.
# REV_ENV="NAME=VALUE ..." sets variables for the other side only: a switch A/B on one revision (out/rev = this HEAD),
# e.g. REV_ENV=SGLANG_DSV4_MOE_DECODE=planes (the MoE's decode planes against the GEMVs).
# A dry run on CPU: CONFIG=TINY_CONFIG_JSON DEVICE=cpu INPUT_LEN=64 BATCHES=2 ROUNDS=1 W=/tmp/w/tiny bash ...
set -u -o pipefail
source scripts/gpu_env.sh
[ -d out/rev/python ] || { echo "out/rev holds no revision: see the header"; exit 1; }
W=${W:-/tmp/w/f12}
BATCHES=${BATCHES:-1 32}
[ -f "$W/config.json" ] || python3 scripts/make_slice_checkpoint.py "${CONFIG:-benchmark/configs/flash-12l256e.config.json}" \
  "$W" --quantize --shard-gb 4 --device "${DEVICE:-cuda}" > "$OUT/checkpoint.txt" 2>&1 || { tail -20 "$OUT/checkpoint.txt"; exit 1; }
graph_bs=$(python3 -c "import sys; m = max(map(int, sys.argv[1:])); print(*[b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= m] or [m])" $BATCHES)
for round in $(seq "${ROUNDS:-2}"); do
  for side in this rev; do
    path=$PWD/python:$PWD/sgl-kernel/python
    extra=()
    [ $side = rev ] && path=$PWD/out/rev/python:$PWD/out/rev/sgl-kernel/python && read -r -a extra <<< "${REV_ENV:-}"
    [ "$round" = 1 ] && env "${extra[@]}" PYTHONPATH=/tmp/site:$path python3 -c \
      "import sglang, sgl_kernel; print('$side:', sglang.__file__, sgl_kernel.__file__, '${extra[*]}')"
    env "${extra[@]}" PYTHONPATH=/tmp/site:$path python3 -m sglang.bench_one_batch --model-path "$W" --input-len "${INPUT_LEN:-1024}" --output-len 32 \
      --batch-size $BATCHES --cuda-graph-bs $graph_bs --prefill-repeats 1 --profile-steps 0 \
      > "$OUT/${side}_$round.txt" 2>&1 || { echo "$side round $round failed"; tail -20 "$OUT/${side}_$round.txt"; exit 1; }
    grep -E "^batch" "$OUT/${side}_$round.txt" | sed "s/^/$side $round: /"
  done
done
