#!/usr/bin/env bash
# This checkout's engine against another revision's, on the quantized flash-12l256e, in one GPU call: decode tok/s
# (CUDA graphs) and prefill per batch size, the two alternated ROUNDS times in one process order (A B A B ...), so a
# change's end-to-end effect is read against the same GPU, clocks and checkpoint.
#   Here first:  rm -rf out/rev && mkdir -p out/rev && git archive REV python sgl-kernel | tar -x -C out/rev
#   Then on the GPU machine (with out/):  [ROUNDS=2] [BATCHES="1 32"] bash scripts/gpu_engine_ab.sh      Logs: $OUT.
# REV_ENV="NAME=VALUE ..." sets variables for the other side only: a switch A/B on one revision (out/rev = this HEAD),
# e.g. REV_ENV=SGLANG_DSV4_MOE_DECODE=planes (the MoE's decode planes against the GEMVs).
# A dry run on CPU: CONFIG=TINY_CONFIG_JSON DEVICE=cpu INPUT_LEN=64 BATCHES=2 ROUNDS=1 W=/tmp/w/tiny bash ...
source "$(dirname "$0")/gpu_env.sh"
[ -d out/rev/python ] || { echo "out/rev holds no revision: see the header"; exit 1; }
TAIL=6 step "limits: copy bandwidth, bf16 matmul" python3 benchmark/kernels/run_all.py --only none
W=${W:-/tmp/w/f12}
BATCHES=${BATCHES:-1 32}
[ -f "$W/config.json" ] || TAIL=4 step "checkpoint" python3 scripts/make_slice_checkpoint.py \
  "${CONFIG:-benchmark/configs/flash-12l256e.config.json}" "$W" --quantize --shard-gb 4 --device "${DEVICE:-cuda}"
graph_bs=$(python3 -c "import sys; m = max(map(int, sys.argv[1:])); print(*[b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= m] or [m])" $BATCHES)

# bench SIDE ROUND: bench_one_batch under SIDE's code (this | rev; rev with REV_ENV), its result lines shown
bench() {
  local path=$PWD/python:$PWD/sgl-kernel/python extra=()
  if [ "$1" = rev ]; then
    path=$PWD/out/rev/python:$PWD/out/rev/sgl-kernel/python
    read -r -a extra <<< "${REV_ENV:-}"
  fi
  env ${extra[@]+"${extra[@]}"} PYTHONPATH=/tmp/site:$path python3 -c \
    "import sglang, sgl_kernel; print('$1:', sglang.__file__, sgl_kernel.__file__, '${extra[*]}')" || return 1
  # shellcheck disable=SC2086
  env ${extra[@]+"${extra[@]}"} PYTHONPATH=/tmp/site:$path python3 -m sglang.bench_one_batch --model-path "$W" \
    --input-len "${INPUT_LEN:-1024}" --output-len 32 --batch-size $BATCHES --cuda-graph-bs $graph_bs \
    --prefill-repeats 1 --profile-steps 0 > "$OUT/$1_$2.txt" 2>&1 || { tail -20 "$OUT/$1_$2.txt"; return 1; }
  grep -E "^batch" "$OUT/$1_$2.txt" | sed "s/^/$1 $2: /"
}

for round in $(seq "${ROUNDS:-2}"); do
  for side in this rev; do
    step "$side, round $round" bench $side "$round"
  done
done
finish
