#!/usr/bin/env bash
# FP8 against bf16 KV cache on one GPU, for the default of --kv-cache-dtype:
#   tests    the Triton backend against the torch one with each cache, the attention and KV store kernels (GPU tests)
#   agree    benchmark/bench_kv_cache_dtype.py on the Flash slice: each cache against the exact engine (fp32), 4,000
#            teacher-forced tokens as forwards of 64
#   short    bench_one_batch with each cache: 1,024-token prompts, decode at batch 1 / 32 / 128 (the pool plan from
#            the start-up log: how many tokens each cache holds)
#   long     the same at 16,384-token prompts, batch 1 / 16
#   prefill  one profiled prefill of 32 x 1,024 tokens with each cache (the top kernels)
#   bash scripts/gpu_kv_dtype.sh   [STEPS="agree short"] [KVS=fp8_e4m3] [STEP_S=400]   Logs and JSON go to $OUT.
source "$(dirname "$0")/gpu_env.sh"
STEPS=${STEPS:-tests agree short long}
STEP_S=${STEP_S:-400}
DROP=Warning
has() { [[ " $STEPS " == *" $1 "* ]]; }
TAIL=6 step "limits: copy bandwidth, bf16 matmul" python3 benchmark/kernels/run_all.py --only none
has tests && TAIL=8 step "GPU tests: Triton vs torch backend with each cache, KV store" python3 -m pytest -q -rfEs \
  -m gpu -p no:cacheprovider -n 4 --tb=short test/srt/test_gpu_triton_backend.py test/kernels/test_dsv4_store_kv.py \
  test/kernels/test_dsv4_sparse_attention.py
[ -f /tmp/w/base/config.json ] || TAIL=2 step "checkpoint: Flash slice" python3 scripts/make_slice_checkpoint.py \
  benchmark/configs/flash-slice-4l32e.config.json /tmp/w/base --device cuda
has agree && TAIL=8 step "agreement: fp8 vs bf16 KV vs exact" python3 benchmark/bench_kv_cache_dtype.py \
  --model-path /tmp/w/base --tokens 4000 --out "$OUT/kv_agreement.json"
for kv in ${KVS:-bfloat16 fp8_e4m3}; do
  has short && TAIL=22 step "decode, 1,024-token prompts, --kv-cache-dtype $kv" python3 -m sglang.bench_one_batch \
    --model-path /tmp/w/base --dtype bfloat16 --kv-cache-dtype "$kv" --input-len 1024 --output-len 32 \
    --batch-size 1 32 128 --cuda-graph-bs 1 2 4 8 16 32 64 128 --profile-steps 3 \
    --result-filename "$OUT/kv_short_$kv.jsonl"
  has long && TAIL=22 step "decode, 16,384-token prompts, --kv-cache-dtype $kv" python3 -m sglang.bench_one_batch \
    --model-path /tmp/w/base --dtype bfloat16 --kv-cache-dtype "$kv" --input-len 16384 \
    --output-len 32 --batch-size 1 16 --cuda-graph-bs 1 2 4 8 16 --prefill-repeats 1 --profile-steps 3 \
    --result-filename "$OUT/kv_long_$kv.jsonl"
  has prefill && TAIL=30 step "prefill profile, 32 x 1,024 tokens, --kv-cache-dtype $kv" python3 -m \
    sglang.bench_one_batch --model-path /tmp/w/base --dtype bfloat16 --kv-cache-dtype "$kv" --input-len 1024 \
    --output-len 2 --batch-size 32 --disable-cuda-graph --profile-steps 0 --profile-prefill
done
finish
