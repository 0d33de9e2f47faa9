#!/usr/bin/env bash
# FP8 linears on a GPU in one call, most decisive first: the FP8 GEMM GPU tests (every engine path, TMA copies),
# every path at 1-4,096 rows (what `fp8_path` encodes), prefill / decode speed of the quantized Flash slice with the
# measured rule and with dequantize + matmul above 64 rows (SGLANG_DSV4_FP8_PREFILL=dequant), its end-to-end
# agreement with the dequantized engine, the kernel table at Flash shapes (bf16, Triton W8A8 / W8A16, cuBLAS W8A8,
# the engine's path) and the producers that quantize.
#   [ROUNDS=2] bash scripts/gpu_fp8_prefill.sh      Logs and JSON go to $OUT.
source "$(dirname "$0")/gpu_env.sh"
TAIL=16 step "FP8 GEMM GPU tests" python3 -m pytest -q -s -m gpu test/kernels/test_dsv4_fp8_gemm.py -p no:cacheprovider
TAIL=70 step "every path at 1-4,096 rows" python3 benchmark/kernels/sweep_fp8_linears.py --out "$OUT/fp8_paths.json"
TAIL=4 step "checkpoint (hub formats)" python3 scripts/make_slice_checkpoint.py \
  benchmark/configs/flash-slice-4l32e.config.json /tmp/w/q --quantize --device cuda
for round in $(seq "${ROUNDS:-2}"); do  # alternated, so drift between runs shows as a spread, not a difference
  for mode in auto dequant; do
    profile=(); [ "$round" = 1 ] && profile=(--profile-prefill)  # GPU busy / launches of one prefill per shape
    TAIL=4 step "one batch, FP8 prefill $mode (round $round)" env SGLANG_DSV4_FP8_PREFILL=$mode python3 -m \
      sglang.bench_one_batch --model-path /tmp/w/q --input-len 1024 --output-len 32 --batch-size 1 32 128 \
      --cuda-graph-bs 1 2 4 8 16 32 64 128 --profile-steps 0 ${profile[@]+"${profile[@]}"}
  done
done
TAIL=8 step "end-to-end agreement" python3 benchmark/bench_fp8_linears.py --model-path /tmp/w/q --skip-kernels \
  --out "$OUT/fp8_end_to_end.json"
TAIL=40 step "kernels" python3 benchmark/bench_fp8_linears.py --out "$OUT/fp8_kernels.json"
TAIL=12 step "producers that quantize" python3 benchmark/bench_fp8_producers.py --out "$OUT/fp8_producers.json"
finish
