#!/usr/bin/env bash
# Decode's quantized kernels on a GPU in one call: the fused MoE's and the FP8 GEMM's GPU tests, the MoE launch sweep
# at decode token counts, the whole MoE op as the engine runs it (GEMVs at 1-8 tokens, parity planes above) and every
# FP8 linear path at decode rows.
#   [SWEEP_S=150] [SWEEP_TOKENS="1 8 32"] bash scripts/gpu_decode_kernels.sh      Logs and JSON: $OUT.
source "$(dirname "$0")/gpu_env.sh"
TAIL=30 step "MoE and FP8 GEMM GPU tests" python3 -m pytest -q -s -m gpu test/kernels/test_dsv4_moe.py \
  test/kernels/test_dsv4_mxfp4_scales.py test/kernels/test_dsv4_pdl.py test/kernels/test_dsv4_moe_gemv.py \
  test/kernels/test_dsv4_fp8_gemm.py -p no:cacheprovider
TAIL=40 step "MoE sweep" python3 benchmark/kernels/sweep_moe_mxfp4.py --tokens ${SWEEP_TOKENS:-1 8 32} --planes \
  --budget-s "${SWEEP_S:-150}" --out "$OUT/sweep_moe.json"
TAIL=10 step "MoE whole op, the engine's path" python3 benchmark/bench_moe_mxfp4.py --profile --gemv \
  --tokens 1 2 4 8 16 32 --out "$OUT/moe_mxfp4.json"
TAIL=30 step "FP8 linears at decode rows" python3 benchmark/kernels/sweep_fp8_linears.py --rows 1 16 32 64 \
  --skip-parts --out "$OUT/fp8_decode_rows.json"
finish
