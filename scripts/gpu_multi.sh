#!/usr/bin/env bash
# Multi-GPU runs of tensor / expert / DP-attention parallelism in one call on a machine with 2 GPUs (or 4, 8: the
# TP4 / TP8 rows run when that many GPUs are there). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the two
# variables beside it below).
#   1. test/srt/test_tensor_parallel.py on GPUs (SGLANG_TEST_DEVICE=cuda: one GPU per rank over NCCL, fp32)
#   2. benchmark/bench_collectives.py: all-reduce / all-gather bus bandwidth against the peer copy
#   3. bench_one_batch on the Flash slice (bf16) and flash-12l256e (quantized): TP1 vs TP2 / TP2 x EP2 / DP-attention
#      2 (and TP4 / TP8): decode tok/s at batch 1, 32, 128 and prefill of 8K prompts, with the profiler's top kernels
#      (the all-reduce / all-gather / reduce-scatter kernels' ms per step among them)
#   4. check_capacity's pool numbers next to the engine's start-up log for the same arguments
#   bash scripts/gpu_multi.sh   [SKIP_F12=1: the Flash slice only; ONLY_F12=1: flash-12l256e only]   Logs go to $OUT.
#   [LAYOUT_LIST="--tp 2 --ep 2;--tp 2 --dp 2 --enable-dp-attention": those layouts only] [TESTS=0] [STEP_S=300]
#   [THREADS_AB=0: skip the TP2 prefill rerun with OMP_NUM_THREADS=4]
# On 2 H200s (2026-12-04) the tests took ~70 s, the slice checkpoint ~20 s, a slice decode run 70-150 s, a prefill run
# 20-45 s: the whole script needs two or three 600-s calls (SKIP_F12=1 with LAYOUT_LIST halves, then flash-12l256e).
# A dry run on CPU (gloo): TESTS=0 MODEL="tiny-deepseek-v4 --device cpu" DECODE_ARGS="--input-len 32 --output-len 4
#   --batch-size 1 2 --profile-steps 0" PREFILL_ARGS="--input-len 64 --output-len 2 --batch-size 1 --profile-steps 0"
#   bash scripts/gpu_multi.sh
source "$(dirname "$0")/gpu_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
case $N in '' | *[!0-9]*) N=0 ;; esac  # no torch, no count: no GPU rows
DECODE_ARGS=${DECODE_ARGS:---input-len 1024 --output-len 32 --batch-size 1 32 128 --cuda-graph-bs 1 2 4 8 16 32 64 128 \
--profile-steps 3}
PREFILL_ARGS=${PREFILL_ARGS:---input-len 8192 --output-len 2 --batch-size 1 4 --profile-steps 0 --disable-cuda-graph \
--profile-prefill}
# Each step is bounded (STEP_S seconds): a hung collective fails its step, and its processes (spawned ranks too) are
# killed before the next one starts. Everything, step names and seconds included, goes to $OUT/log.txt as it
# happens (a call cut short still brings back what ran).
STEP_S=${STEP_S:-300}
after_failed_step() { pkill -9 -f "python3 -m sglang|tp_worker.py|multiprocessing" || true; }
say "GPUs: $N"
nvidia-smi topo -m 2>&1 | head -4 | tee -a "$LOG"
if [ "${TESTS:-1}" = 1 ]; then
  # parallel workers (pytest-xdist, in the image): each test's ranks are processes of their own; a per-test bound
  # (pytest-timeout) so that a hang fails one test with its stack, and the summary prints before STEP_S
  TAIL=12 step "TP / EP / DP exactness on GPUs" env SGLANG_TEST_DEVICE=cuda python3 -m pytest -q -rfEs \
    -p no:cacheprovider -n "${TEST_WORKERS:-12}" --timeout 150 --tb=short -W ignore test/srt/test_tensor_parallel.py
fi
# the collectives at the engine's message sizes against the peer copy bandwidth (the physical limit)
[ "$N" -ge 2 ] && TAIL=6 step "collectives vs peer copy" python3 benchmark/bench_collectives.py --world 2 \
  --out "$OUT/collectives.json"
LAYOUTS=("--tp 1" "--tp 2" "--tp 2 --ep 2" "--tp 2 --dp 2 --enable-dp-attention")
[ "$N" -ge 4 ] && LAYOUTS+=("--tp 4" "--tp 4 --ep 4")
[ "$N" -ge 8 ] && LAYOUTS+=("--tp 8" "--tp 8 --ep 8")
if [ -n "${LAYOUT_LIST:-}" ]; then IFS=';' read -ra LAYOUTS <<< "$LAYOUT_LIST"; fi
if [ -n "${MODEL:-}" ]; then
  MODELS=("$MODEL")
  BASE=$MODEL
elif [ "${ONLY_F12:-0}" != 1 ]; then
  TAIL=2 step "checkpoint: Flash slice" python3 scripts/make_slice_checkpoint.py \
    benchmark/configs/flash-slice-4l32e.config.json /tmp/w/base --device cuda
  MODELS=("/tmp/w/base --dtype bfloat16")
  BASE=/tmp/w/base
else
  MODELS=()
fi
if [ -z "${MODEL:-}" ] && [ "${SKIP_F12:-0}" != 1 ]; then
  TAIL=2 step "checkpoint: flash-12l256e quantized" python3 scripts/make_slice_checkpoint.py \
    benchmark/configs/flash-12l256e.config.json /tmp/w/f12 --quantize --shard-gb 4 --device cuda
  MODELS+=("/tmp/w/f12")
  BASE=${BASE:-/tmp/w/f12}
fi
for model in "${MODELS[@]}"; do
  for layout in "${LAYOUTS[@]}"; do
    # shellcheck disable=SC2086
    TAIL=14 step "decode: $model $layout" python3 -m sglang.bench_one_batch --model-path $model $layout $DECODE_ARGS
    # shellcheck disable=SC2086
    TAIL=3 step "prefill: $model $layout" python3 -m sglang.bench_one_batch --model-path $model $layout $PREFILL_ARGS
    if [ "$layout" = "--tp 2" ] && [ "${THREADS_AB:-1}" = 1 ]; then
      # TP2 prefill ran at 0.46-0.62x TP1, 45% GPU-busy (2026-12-04): one suspect is each rank's 32 torch threads
      # shaping host work on 32 cores; the same run with 4 per rank tells
      # shellcheck disable=SC2086
      TAIL=3 step "prefill: $model $layout, 4 torch threads per rank" env OMP_NUM_THREADS=4 python3 -m \
        sglang.bench_one_batch --model-path $model $layout $PREFILL_ARGS
    fi
  done
done
for layout in "--tp 2" "--tp 2 --ep 2"; do  # the planner's numbers for the engine's arguments, then the engine's
  # shellcheck disable=SC2086
  TAIL=12 step "planner: $layout" python3 -m sglang.check_capacity ${BASE%% *} $layout --gpu h200
  log="$OUT/engine_log_${layout// /_}.txt"  # the engine's start-up log for the same (pools, weights per GPU)
  TAIL=12 step "engine log: $layout" bash -c "python3 -m sglang.bench_one_batch --model-path $BASE $layout \
    --batch-size 1 --input-len 16 --output-len 2 --profile-steps 0 --log-level debug > '$log' 2>&1 \
    || { tail -20 '$log'; exit 1; }; grep -E 'weights on|graph memory|page size|full tokens|window slots|pools total' '$log'; true"
done
finish
