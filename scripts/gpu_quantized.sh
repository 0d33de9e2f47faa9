#!/usr/bin/env bash
# Quantized weights on a GPU in one device call (issue 13): the FP8 and MXFP4 kernel tests, the fused-MoE and FP8
# benchmarks, and the Flash slice end to end in hub formats (agreement with the dequantized engine, decode speed).
# Results (JSON) and the log go to $OUT.   bash scripts/gpu_quantized.sh   (carry .whl: the test wheels)
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
FAILED=()
step() { local name=$1; shift; echo "=== $name"; ( "$@" ) 2>&1 | tee -a "$OUT/quantized_log.txt" | tail -"${TAIL:-30}" \
  || { FAILED+=("$name"); echo "=== FAILED: $name"; }; }
export PYTHONUNBUFFERED=1 SGLANG_CACHE_DIR=/tmp/sgcache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel/python
else
  export PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
fi
CONFIG=benchmark/configs/flash-slice-4l32e.config.json
step "kernel tests" python3 -m pytest -q -s -m gpu test/kernels/test_dsv4_moe_mxfp4.py test/kernels/test_dsv4_mxfp4_scales.py \
  test/kernels/test_dsv4_pdl.py test/kernels/test_dsv4_moe_gemv.py test/kernels/test_dsv4_fp8_gemm.py \
  -p no:cacheprovider
step "fused MXFP4 MoE" python3 benchmark/bench_moe_mxfp4.py --out "$OUT/moe_mxfp4.json"
step "checkpoint (hub formats)" python3 scripts/make_slice_checkpoint.py "$CONFIG" /tmp/w/q --quantize
step "FP8 linears + end to end" python3 benchmark/bench_fp8_linears.py --model-path /tmp/w/q --skip-kernels \
  --out "$OUT/fp8_end_to_end.json"
for q in fp8 none; do
  step "decode, --quantization $q" python3 -m sglang.bench_one_batch --model-path /tmp/w/q --quantization "$q" \
    --input-len 1024 --output-len 32 --batch-size 1 32 --cuda-graph-bs 1 2 4 8 16 32 --profile-steps 0
done
if [ ${#FAILED[@]} -gt 0 ]; then printf 'failed step: %s\n' "${FAILED[@]}"; exit 1; fi
echo "all steps passed"
