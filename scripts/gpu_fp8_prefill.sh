#!/usr/bin/env bash
# FP8 prefill GEMMs through cuBLAS's blockwise-scaled recipe on a GPU in one device call (issue 13): the FP8 GEMM GPU
# tests (cuBLAS W8A8 included), the kernel table at Flash shapes (bf16, Triton W8A8 / W8A16, cuBLAS W8A8, the
# engine's path), the quantized Flash slice's end-to-end agreement with the dequantized engine, and prefill / decode
# speed with the cuBLAS path and with dequantize + matmul (SGLANG_DSV4_FP8_PREFILL=dequant).
#   bash scripts/gpu_fp8_prefill.sh   (carry .whl: the test wheels)   Logs and JSON go to $OUT.
set -u -o pipefail
source scripts/gpu_env.sh
FAILED=()
step() { local name=$1; shift; echo "=== $name"; ( "$@" ) 2>&1 | tee -a "$OUT/fp8_log.txt" | tail -"${TAIL:-20}" \
  || { FAILED+=("$name"); echo "=== FAILED: $name"; }; }
TAIL=16 step "FP8 GEMM GPU tests" python3 -m pytest -q -s -m gpu test/kernels/test_dsv4_fp8_gemm.py -p no:cacheprovider
TAIL=30 step "kernels" python3 benchmark/bench_fp8_linears.py --out "$OUT/fp8_kernels.json"
TAIL=4 step "checkpoint (hub formats)" python3 scripts/make_slice_checkpoint.py \
  benchmark/configs/flash-slice-4l32e.config.json /tmp/w/q --quantize --device cuda
TAIL=6 step "end-to-end agreement" python3 benchmark/bench_fp8_linears.py --model-path /tmp/w/q --skip-kernels \
  --out "$OUT/fp8_end_to_end.json"
for mode in auto dequant; do
  TAIL=4 step "one batch, FP8 prefill $mode" env SGLANG_DSV4_FP8_PREFILL=$mode python3 -m sglang.bench_one_batch \
    --model-path /tmp/w/q --input-len 1024 --output-len 32 --batch-size 1 32 --cuda-graph-bs 1 2 4 8 16 32
done
if [ ${#FAILED[@]} -gt 0 ]; then printf 'failed step: %s\n' "${FAILED[@]}"; exit 1; fi
echo "all steps passed"
