#!/usr/bin/env bash
# The fused MXFP4 MoE on a GPU in one call: its GPU tests at Flash widths (tl.dot_scaled, the in-register path, the
# parity planes, the 1-8 token GEMVs), the fp32 W8A16 tests, the launch sweep, the whole op with a kernel profile
# (the sweep's best launches; the engine's path: GEMVs at 1-8 tokens, then the planes; the planes alone), the GEMV
# kernels' tiles and the chain's variants (sweep_moe_gemv.py), and (E2E=1, the default) the quantized Flash slice's
# agreement with the dequantized engine.
#   [SWEEP_S=240] [SWEEP_TOKENS="1 32 256 4096"] [E2E=0] bash scripts/gpu_moe.sh
#   DECODE_ONLY=1 bash scripts/gpu_moe.sh: only the GEMV tests, the engine's path at 1-32 tokens and the GEMV sweep
#   (the decode figures, ~7 minutes)
# Logs and JSON go to $OUT.
source "$(dirname "$0")/gpu_env.sh"
if [ "${DECODE_ONLY:-0}" = 1 ]; then
  TAIL=8 step "GEMV GPU tests (variants included)" python3 -m pytest -q -s -m gpu test/kernels/test_dsv4_moe_gemv.py \
    -p no:cacheprovider
  TAIL=10 step "whole op, the engine's path at decode sizes" python3 benchmark/bench_moe_mxfp4.py --gemv \
    --tokens 1 2 4 8 16 32 --out "$OUT/moe_mxfp4_engine_decode.json"
  TAIL=14 step "GEMV tiles per kernel and the chain's variants" python3 benchmark/kernels/sweep_moe_gemv.py \
    --tokens 1 2 4 8 --out "$OUT/sweep_gemv.json"
  finish
fi
TAIL=14 step "MoE GPU tests (1, 32 tokens)" python3 -m pytest -q -s -m gpu test/kernels/test_dsv4_moe.py \
  test/kernels/test_dsv4_mxfp4_scales.py test/kernels/test_dsv4_pdl.py test/kernels/test_dsv4_moe_gemv.py \
  -k "not 4096" -p no:cacheprovider
TAIL=6 step "fp32 W8A16 GPU tests" python3 -m pytest -q -m gpu test/kernels/test_dsv4_fp8_gemm.py -k fp32 \
  -p no:cacheprovider
TAIL=60 step "sweep" python3 benchmark/kernels/sweep_moe_mxfp4.py --tokens ${SWEEP_TOKENS:-1 32 256 4096} --planes \
  --budget-s "${SWEEP_S:-240}" --out "$OUT/sweep_moe.json"
TAIL=8 step "whole op, the sweep's best" python3 benchmark/bench_moe_mxfp4.py --profile --tokens 1 8 32 128 256 4096 \
  --config-from "$OUT/sweep_moe.json" --out "$OUT/moe_mxfp4.json"
TAIL=8 step "whole op, the engine's path (GEMVs at 1-8 tokens, then the planes)" python3 benchmark/bench_moe_mxfp4.py \
  --gemv --tokens 1 2 4 8 32 128 256 4096 --out "$OUT/moe_mxfp4_engine.json"
TAIL=14 step "GEMV tiles per kernel and the chain's variants" python3 benchmark/kernels/sweep_moe_gemv.py \
  --tokens 1 2 4 8 --out "$OUT/sweep_gemv.json"
TAIL=8 step "whole op, the parity planes at every decode batch" python3 benchmark/bench_moe_mxfp4.py --planes \
  --tokens 1 2 4 8 32 128 256 4096 --out "$OUT/moe_mxfp4_planes.json"
if [ "${E2E:-1}" = 1 ]; then  # the quantized Flash slice against the dequantized engine (fp32 and bf16 agreement)
  TAIL=10 step "checkpoint (hub formats)" python3 scripts/make_slice_checkpoint.py \
    benchmark/configs/flash-slice-4l32e.config.json /tmp/w/q --quantize
  TAIL=25 step "end-to-end agreement" python3 benchmark/bench_fp8_linears.py --model-path /tmp/w/q --skip-kernels \
    --out "$OUT/fp8_end_to_end.json"
fi
finish
