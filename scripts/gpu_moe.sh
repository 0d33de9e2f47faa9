#!/usr/bin/env bash
# The fused MoE on a GPU in one device call (issue 13): its GPU tests at Flash widths (tl.dot_scaled and the
# in-register path; the W4A8 op; the 1-8 token GEMVs), the fp32 W8A16 tests, the launch sweep, the whole-op benchmark
# with a kernel profile (W4A16: the engine path and the planes alone; W4A8), the GEMV kernels' tiles and the chain's
# variants (sweep_moe_gemv.py), and (E2E=1, the default) the quantized Flash slice's agreement with the dequantized
# engine.
# The whole-op figures use the sweep's best launches per token count (--config-from).
#   [SWEEP_S=240] [SWEEP_TOKENS="1 32 256 4096"] [E2E=0] bash scripts/gpu_moe.sh   (carry .whl: the test wheels)
#   DECODE_ONLY=1 bash scripts/gpu_moe.sh: only the GEMV tests, the engine path at 1-32 tokens and the GEMV sweep (the
#   decode figures, when device time is short)
# Logs and JSON go to $OUT.
set -u -o pipefail
source scripts/gpu_env.sh
FAILED=()
step() { local name=$1; shift; echo "=== $name"; ( "$@" ) 2>&1 | tee -a "$OUT/moe_log.txt" | tail -"${TAIL:-20}" \
  || { FAILED+=("$name"); echo "=== FAILED: $name"; }; }
if [ "${DECODE_ONLY:-0}" = 1 ]; then  # the decode figures first, when device time is short (~7 minutes)
  TAIL=8 step "GEMV GPU tests (variants included)" python3 -m pytest -q -s -m gpu test/kernels/test_dsv4_moe_gemv.py \
    -p no:cacheprovider
  TAIL=10 step "whole op, the engine's path at decode sizes" python3 benchmark/bench_moe_mxfp4.py --gemv \
    --tokens 1 2 4 8 16 32 --out "$OUT/moe_mxfp4_engine_decode.json"
else
TAIL=14 step "MoE GPU tests (1, 32 tokens)" python3 -m pytest -q -s -m gpu test/kernels/test_dsv4_moe_mxfp4.py \
  test/kernels/test_dsv4_mxfp4_scales.py test/kernels/test_dsv4_pdl.py test/kernels/test_dsv4_moe_w4a8.py \
  test/kernels/test_dsv4_moe_gemv.py \
  -k "not 4096" -p no:cacheprovider
TAIL=6 step "fp32 W8A16 GPU tests" python3 -m pytest -q -m gpu test/kernels/test_dsv4_fp8_gemm.py -k fp32 \
  -p no:cacheprovider
TAIL=60 step "sweep" python3 benchmark/kernels/sweep_moe_mxfp4.py --tokens ${SWEEP_TOKENS:-1 32 256 4096} --planes \
  --budget-s "${SWEEP_S:-240}" --out "$OUT/sweep_moe.json"
TAIL=8 step "whole op, the sweep's best" python3 benchmark/bench_moe_mxfp4.py --profile --tokens 1 8 32 128 256 4096 \
  --config-from "$OUT/sweep_moe.json" --out "$OUT/moe_mxfp4.json"
TAIL=8 step "whole op, the engine's path (GEMVs at 1-8 tokens, then the planes)" python3 benchmark/bench_moe_mxfp4.py \
  --gemv --tokens 1 2 4 8 32 128 256 4096 --out "$OUT/moe_mxfp4_engine.json"
fi
TAIL=14 step "GEMV tiles per kernel and the chain's variants (sweep_moe_gemv.py: graph replays, two passes)" \
  python3 benchmark/kernels/sweep_moe_gemv.py --tokens 1 2 4 8 --out "$OUT/sweep_gemv.json"
if [ "${DECODE_ONLY:-0}" != 1 ]; then
TAIL=8 step "whole op, the parity planes at every decode batch" python3 benchmark/bench_moe_mxfp4.py --planes \
  --tokens 1 2 4 8 32 128 256 4096 --out "$OUT/moe_mxfp4_planes.json"
TAIL=8 step "whole op, W4A8 (--mxfp4-moe-precision fp8)" python3 benchmark/bench_moe_mxfp4.py \
  --mxfp4-moe-precision fp8 --tokens 1 8 32 128 256 4096 --out "$OUT/moe_w4a8.json"
fi
if [ "${E2E:-1}" = 1 ] && [ "${DECODE_ONLY:-0}" != 1 ]; then  # the quantized Flash slice against the dequantized engine (fp32 and bf16 agreement)
  TAIL=10 step "checkpoint (hub formats)" python3 scripts/make_slice_checkpoint.py \
    benchmark/configs/flash-slice-4l32e.config.json /tmp/w/q --quantize
  TAIL=25 step "end-to-end agreement" python3 benchmark/bench_fp8_linears.py --model-path /tmp/w/q --skip-kernels \
    --out "$OUT/fp8_end_to_end.json"
fi
if [ ${#FAILED[@]} -gt 0 ]; then printf 'failed step: %s\n' "${FAILED[@]}"; exit 1; fi
echo "all steps passed"
