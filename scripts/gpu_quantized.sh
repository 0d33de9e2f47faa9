#!/usr/bin/env bash
# Quantized weights on a GPU in one call: the FP8 and MXFP4 kernel tests, the fused MoE as the engine runs it, and
# the Flash slice end to end in hub formats (agreement with the dequantized engine, decode speed quantized and
# dequantized in the same call). Results (JSON) and the log go to $OUT.
#   bash scripts/gpu_quantized.sh
source "$(dirname "$0")/gpu_env.sh"
CONFIG=benchmark/configs/flash-slice-4l32e.config.json
TAIL=6 step "limits: copy bandwidth, bf16 matmul" python3 benchmark/kernels/run_all.py --only none
TAIL=30 step "kernel tests" python3 -m pytest -q -s -m gpu test/kernels/test_dsv4_moe.py \
  test/kernels/test_dsv4_mxfp4_scales.py test/kernels/test_dsv4_pdl.py test/kernels/test_dsv4_moe_gemv.py \
  test/kernels/test_dsv4_fp8_gemm.py -p no:cacheprovider
TAIL=10 step "fused MXFP4 MoE, the engine's path" python3 benchmark/bench_moe_mxfp4.py --gemv \
  --tokens 1 8 32 128 256 4096 --out "$OUT/moe_mxfp4.json"
TAIL=4 step "checkpoint (hub formats)" python3 scripts/make_slice_checkpoint.py "$CONFIG" /tmp/w/q --quantize
TAIL=10 step "FP8 linears + end to end" python3 benchmark/bench_fp8_linears.py --model-path /tmp/w/q --skip-kernels \
  --out "$OUT/fp8_end_to_end.json"
for q in fp8 none; do
  TAIL=6 step "decode, --quantization $q" python3 -m sglang.bench_one_batch --model-path /tmp/w/q --quantization "$q" \
    --input-len 1024 --output-len 32 --batch-size 1 32 --cuda-graph-bs 1 2 4 8 16 32 --profile-steps 0
done
finish
